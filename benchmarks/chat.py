"""Plain chat requests: open questions whose answers are not in their prompts, where prompt lookup finds little and
a draft model has to predict the text itself (`bench.py --workload chat`)."""
from transformers import PreTrainedTokenizerBase

from benchmarks.grounded import chat_token_ids

QUESTIONS = [
    "What are three good habits for writing readable code?",
    "Explain why the sky is blue in a few sentences.",
    "Give me a short recipe for a vegetable soup.",
    "What should I pack for a weekend hiking trip?",
    "Write a short story about a cat who learns to swim.",
    "How does a bicycle stay upright when it moves?",
    "Suggest a plan for learning a new language in three months.",
    "What is the difference between weather and climate?",
]


def chat_prompts(tokenizer: PreTrainedTokenizerBase, num_prompts: int) -> list[list[int]]:
    """`num_prompts` one-turn chat prompts cycling through the questions, as token ids."""
    return chat_token_ids(tokenizer, [QUESTIONS[i % len(QUESTIONS)] for i in range(num_prompts)])

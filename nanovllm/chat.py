from transformers import PreTrainedTokenizerBase


def chat_prompt(tokenizer: PreTrainedTokenizerBase, message: str) -> str:
    """`message` as one user turn in the model's chat template, ready for the assistant's reply; unchanged for a
    tokenizer without a template (a base model)."""
    if not tokenizer.chat_template:
        return message
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)

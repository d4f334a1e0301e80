"""Input-grounded requests: copy, edit, annotate, correct, number, reformat or extract from a given passage or piece
of code, as chat prompts: 8 kinds of task over 4 passages (prose and code). Much of such an answer is in its prompt,
which is where prompt-lookup speculation pays (`bench.py --workload grounded`)."""
from transformers import PreTrainedTokenizerBase

PASSAGES = [
    "The river wound slowly through the valley, past the old mill and the stone bridge, where children gathered "
    "every summer to fish and swim. In autumn the leaves turned red and gold, and the farmers brought their harvest "
    "to the market in the square. The baker opened his shop before dawn, and the smell of fresh bread filled the "
    "narrow streets long before the church bells rang.",
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n        else:\n"
    "            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n"
    "    result.extend(right[j:])\n    return result\n",
    "Our meeting is scheduled for Tuesday at ten in the morning in the large conference room on the third floor. "
    "Please bring the quarterly report, the updated budget and your notes from the customer visits. We will review "
    "the sales figures first, then discuss the hiring plan for the next quarter, and finish with open questions.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n\n    def is_empty(self):\n        return not self.items\n",
]
TASKS = [
    "Repeat the following text exactly, word for word.\n\n{passage}",
    "Rewrite the following text with every sentence or line kept in the same order, changing as little as "
    "possible.\n\n{passage}",
    "Copy the following text and add a short comment after it.\n\n{passage}",
    "Correct any mistakes in the following text and return all of it, corrected.\n\n{passage}",
    "Return the following text with each sentence or line numbered, starting at 1.\n\n{passage}",
    "Turn the following text into a bulleted list, one bullet per sentence or line, keeping the wording.\n\n{passage}",
    "Quote the first half of the following text exactly, then summarize the rest in one sentence.\n\n{passage}",
    "Find the longest sentence or line in the following text and return it exactly as written.\n\n{passage}",
]

def grounded_prompts(tokenizer: PreTrainedTokenizerBase, num_prompts: int) -> list[list[int]]:
    """`num_prompts` chat prompts, every task on the first passage, then on the next, ..., as token ids (the model's
    chat template): 32 cover every task on every passage."""
    return chat_token_ids(tokenizer, [TASKS[i % len(TASKS)].format(passage=PASSAGES[i // len(TASKS) % len(PASSAGES)])
                                      for i in range(num_prompts)])


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, contents: list[str]) -> list[list[int]]:
    """Each user message as a one-turn chat prompt's token ids (the model's chat template)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for content in contents]

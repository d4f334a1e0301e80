# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ported in small form from vllm 0.33.0 (4ba787ec9) tests/utils.py and vllm/utils/torch_utils.py: the helpers the
# ported logits processor tests import from vLLM's tests package (`from tests.utils import ...`).
"""vLLM's test helpers as the CPU runs them: `create_new_process_for_each_test` runs the test in this process (vLLM
forks one per test to give the GPU's memory back between engines; nanovllm's engines free theirs when dropped, and
forking a process that holds torch's CPU thread pools is what the fork would risk here)."""
import random

import numpy as np
import torch
from vllm.platforms import current_platform


def requires_spawn_multiprocessing() -> bool:
    """Whether this platform requires spawn instead of fork for test processes."""
    return current_platform.is_rocm() or current_platform.is_xpu()


def create_new_process_for_each_test(method=None):
    """vLLM's decorator, which runs each test in a new process; here the test runs as it is (see the module)."""
    return lambda func: func


def set_random_seed(seed: int | None, data_parallel_index: int = 0) -> None:
    if seed is not None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

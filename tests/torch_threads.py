"""One torch thread for a module's transformers references (an autouse
fixture: ``from torch_threads import one_torch_thread  # noqa: F401``).

A reference decodes a token at a time: operations of one row, too small
to split, where a second OpenMP thread only spins at each parallel region
(torch's libgomp busy-waits). On a 2-core machine under load a SmolLM2
``hf_greedy`` of 16 tokens took 5-7 s of CPU with torch's default two
threads and 1.3 s with one (and less wall time too). Paddle's threads
(its own libiomp5 and MKL) are not torch's and do not change."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

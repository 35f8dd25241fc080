"""The pieces of rlfleet/models/sampling.py an engine that draws one decode step at a time uses (vLLM's
worker, rlfleet/engines/vllm_worker.py): they must give exactly what the torch engine and
the gate's replay compute on whole sequences."""

from __future__ import annotations

import numpy as np
import torch

from rlfleet.models.sampling import UniformStream, keep_mask, keep_mask_rows, sample_seed, sample_uniforms


def test_a_lazily_read_uniform_stream_is_exactly_the_whole_streams():
    for seed in (0, 1, sample_seed(2**40 + 17, 3), 2**63 - 1):
        n = 3 * UniformStream.CHUNK + 5  # several chunks, the last one partly read
        whole = sample_uniforms(seed, n)
        stream = UniformStream(seed)
        order = [0, 1, UniformStream.CHUNK - 1, UniformStream.CHUNK, 2, n - 1, 7, n - 2]  # out of order: preemption
        got = [stream[t] for t in order]
        assert got == [float(whole[t]) for t in order]  # bit for bit, not approximately
        assert np.array_equal(np.array([stream[t] for t in range(n)]), whole)


def test_a_uniform_stream_refuses_a_negative_position():
    stream = UniformStream(5)
    try:
        stream[-1]
    except IndexError:
        return
    raise AssertionError("a negative position read the stream from its end")


def test_keep_mask_rows_is_each_rows_own_keep_mask():
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    filters = [(1.0, 0), (0.9, 0), (1.0, 5), (0.7, 8), (0.9, 0), (1.0, 0)]
    keep = keep_mask_rows(logits, filters)
    for row, (top_p, top_k) in enumerate(filters):
        assert torch.equal(keep[row], keep_mask(logits[row : row + 1], top_p, top_k)[0])
    assert torch.equal(keep_mask_rows(logits, [(0.8, 4)] * 6), keep_mask(logits, 0.8, 4))

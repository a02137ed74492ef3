"""zeropp/reducers.py's ErrorFeedback on its own: the formulas replayed in plain Python, its state round trip."""

import torch

from zeropp.reducers import ErrorFeedback


def _round(fb, key, g, compress, memory=None):
    """One round as a compressor runs it: h = g + e, C(h), the loss fed back; returns C(h)."""
    h = g.clone()
    kept = fb.begin(key, h, memory)
    sent = compress(h)
    if kept:
        lost = fb.loss_buffer(key, h.numel(), h.device)
        lost.copy_(h - sent)
        fb.end(key, lost)
    return sent


def test_moving_average_and_reset_follow_the_formulas():
    """memory 0.5 and 0 (the loss written in place), a reset every 3 rounds, against lists of floats."""
    halve = lambda h: h * 0.5  # noqa: E731  (a lossy "compressor": sends half)
    for memory in (0.5, 0.0):
        fb = ErrorFeedback(memory, reset_interval=3)
        e = [0.0, 0.0]
        for k in range(6):  # resets at rounds 0 and 3
            g = torch.tensor([1.0 + k, -2.0 * k])
            sent = _round(fb, "u", g, halve)
            h = [gi + ei for gi, ei in zip(g.tolist(), e)]
            assert sent.tolist() == [0.5 * x for x in h]
            e = [0.0, 0.0] if k % 3 == 0 else [memory * ei + (1 - memory) * (x - 0.5 * x) for ei, x in zip(e, h)]
            assert fb.errors.get("u", torch.zeros(2)).tolist() == e, (memory, k)
        assert fb.round("u") == 6 and any(e)


def test_state_resumes_the_same_rounds_and_an_orphan_error_is_sent_once():
    fb = ErrorFeedback(0.8, reset_interval=4)
    for k in range(5):
        _round(fb, "u", torch.full((3,), float(k + 1)), torch.round)
    copy = ErrorFeedback(0.8, reset_interval=4)
    copy.load_state_dict({k: v.clone() for k, v in fb.state_dict().items()})
    for k in range(5, 9):  # crosses the reset at round 8
        g = torch.linspace(-1, 1, 3) * (k + 0.3)
        assert torch.equal(_round(fb, "u", g, torch.round), _round(copy, "u", g, torch.round))
        assert torch.equal(fb.errors["u"], copy.errors["u"])
    # Without feedback (memory 1) an error left from before goes out once, then is dropped
    off = ErrorFeedback(1.0)
    off.load_state_dict({"u.error": torch.tensor([0.25, -0.5, 1.0])})
    h = torch.zeros(3)
    assert not off.begin("u", h) and h.tolist() == [0.25, -0.5, 1.0] and not off.errors["u"].any()

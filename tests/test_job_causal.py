"""A job's MFU in both conventions for a causal attention's square: in full (PaLM, torchtitan) and halved
(Megatron, MaxText), the halved one taking half the score work off every call the trace records with
``is_causal`` True (its ``Concrete Inputs``). Real torch.profiler traces of a CPU step, priced against the
attention formulas worked here."""
import pytest
import torch
import torch.nn.functional as F

from flopcount.profiles.job import JobError, read_job

B, H, L, E = 2, 4, 64, 16
ITERATIONS = 2


def _trace(path, causal: bool) -> str:
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(B, H, L, E, requires_grad=True) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(ITERATIONS):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
    prof.export_chrome_trace(str(path))
    return str(path)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    out = {}
    for name, causal in (("causal", True), ("plain", False)):
        folder = tmp_path_factory.mktemp(name)
        for rank in (0, 1):
            _trace(folder / f"rank{rank}.json", causal)
        out[name] = str(folder)
    return out


def _removed_by_hand() -> int:
    """Per iteration: the forward charges ``B H L^2 (2E + 2E + 5 + 1)`` on the whole square (scores, softmax, mask,
    weighted values), the backward ``B H (L^2 (6E + 4E + 5 + 1) + 2 E L)``; halved, the square's terms are half."""
    forward = B * H * L * L * (4 * E + 6) // 2
    backward = B * H * L * L * (10 * E + 6) // 2  # the per-row 2 E L term stays whole
    return ITERATIONS * (forward + backward)


def test_the_halved_mfu_takes_half_of_each_causal_square_off(traces):
    job = read_job([traces["causal"]], "trace", workers=1, peak=1e9)
    ranks, j = job.ranks, job.job
    assert list(ranks["flops_causal_removed"]) == [_removed_by_hand()] * 2
    for r in ranks.itertuples():
        assert r.mfu_causal_full == pytest.approx(r.flops / (r.step_s * 1e9))
        assert r.mfu_causal_half == pytest.approx((r.flops - _removed_by_hand()) / (r.step_s * 1e9))
        assert r.mfu == r.mfu_causal_full  # the full square leads by default
    assert j["causal_attention"] and j["causal_convention"] == "full" and j["mfu"] == j["mfu_causal_full"]
    assert j["mfu_causal_half"] == pytest.approx((j["flops"] - 2 * _removed_by_hand()) / (j["step_s"] * 2e9))


def test_the_halved_convention_leads_when_asked(traces):
    job = read_job([traces["causal"]], "trace", workers=1, peak=1e9, causal="half")
    assert job.job["mfu"] == job.job["mfu_causal_half"] < job.job["mfu_causal_full"]
    assert (job.ranks["mfu"] == job.ranks["mfu_causal_half"]).all()
    from flopcount.cli.job import job_table

    text = " ".join(job_table(job).split())  # the notes wrap at the terminal's width
    assert "causal square halved: Megatron, MaxText; the rows' MFU %" in text
    assert "causal square in full: PaLM, torchtitan" in text


def test_attention_not_causal_gives_one_figure(traces):
    job = read_job([traces["plain"]], "trace", workers=1, peak=1e9)
    assert not job.job["causal_attention"] and job.job["mfu_causal_half"] == job.job["mfu_causal_full"]
    from flopcount.cli.job import job_table

    assert "agree" in job_table(job)


def test_an_unknown_convention_is_refused_before_anything_is_read(tmp_path):
    with pytest.raises(JobError, match="unknown causal convention 'quarter'"):
        read_job([str(tmp_path / "none")], "trace", causal="quarter")

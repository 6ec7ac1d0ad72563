"""Sorting, selection, NMS and RoI pooling formulas, hand-worked. A comparison of two floats is 1 FLOP."""
import torch
import torchvision

import flopcount
from flopcount.formulas import NeedsValues, lookup
from helpers import Fn, op_flops


def forward(fn, x, *shapes, device="meta"):
    r = flopcount.count(Fn(fn, *shapes), x, backward=False, device=device)
    assert r.uncounted == {} and r.notes == []
    return r


def test_sort_counts_n_ceil_log2_n_per_slice():
    # 2 slices of 8: 2 x 8 x 3 = 48, along either dim
    assert op_flops(forward(lambda x, w: (x * w).sort()[0], torch.randn(2, 8), (1,)), "aten.sort", "forward") == 48
    r = forward(lambda x, w: (x * w).sort(dim=0)[0], torch.randn(8, 2), (1,))
    assert op_flops(r, "aten.sort", "forward") == 48


def test_topk_counts_a_pass_and_sorts_the_chosen():
    # 2 slices of 10, top 3: 2 x (10 + 3 x 2) = 32; unsorted: 2 x 10 = 20
    r = forward(lambda x, w: (x * w).topk(3)[0], torch.randn(2, 10), (1,))
    assert op_flops(r, "aten.topk", "forward") == 32
    r = forward(lambda x, w: (x * w).topk(3, sorted=False)[0], torch.randn(2, 10), (1,))
    assert op_flops(r, "aten.topk", "forward") == 20


BOXES = torch.tensor([[0., 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [21, 21, 31, 31]])
SCORES = torch.tensor([0.9, 0.8, 0.7, 0.6])


def test_nms_replays_the_suppression():
    # A keeps and is compared with B, C, D (3 pairs) and suppresses B (IoU 81 / 119 = 0.68); C keeps and is
    # compared with D (1 pair), suppressing it: 4 pairs x 13 + 4 areas x 3 + a sort of 4 (4 x 2) = 72
    assert torchvision.ops.nms(BOXES, SCORES, 0.5).tolist() == [0, 2]
    assert lookup("torchvision.nms")(BOXES, SCORES, 0.5) == 72
    # with a threshold nothing passes, every later box stays live: 3 + 2 + 1 = 6 pairs -> 78 + 12 + 8 = 98
    assert lookup("torchvision.nms")(BOXES, SCORES, 0.99) == 98


def test_nms_needs_values_and_a_step_with_it_is_counted_on_the_cpu(capsys):
    def step(b, w):
        keep = torchvision.ops.nms(b * w, SCORES.to(b.device), 0.5)
        return (b * w)[keep].sum()

    with __import__("pytest").raises(NeedsValues):
        lookup("torchvision.nms")(BOXES.to("meta"), SCORES.to("meta"), 0.5)
    model = Fn(step, (1,))
    with torch.no_grad():
        model.ps[0].fill_(1.0)
    meta = flopcount.count(model, BOXES)
    cpu = flopcount.count(model, BOXES, device="cpu")
    assert op_flops(meta, "torchvision.nms", "forward") == op_flops(cpu, "torchvision.nms", "forward") == 72
    assert meta.total() == cpu.total() and meta.meta["device"] == "cpu"
    assert "counted on the CPU" in capsys.readouterr().err


def _align(rois, sampling_ratio, device="cpu"):
    def fn(x, w):
        return torchvision.ops.roi_align(x * w, rois.to(x.device), (2, 2), 1.0, sampling_ratio)
    return flopcount.count(Fn(fn, (1,)), torch.randn(1, 2, 8, 8), device=device)


def test_roi_align_counts_samples_per_bin():
    # one 4 x 4 box, 2 x 2 bins, 2 x 2 samples per bin (S = 4), 2 channels:
    # 4 bins x (20 per sample position x 4 + 2 channels x (8 x 4 + 1)) = 4 x (80 + 66) = 584, forward and backward
    r = _align(torch.tensor([[0., 0, 0, 4, 4]]), 2, device="meta")
    assert op_flops(r, "torchvision.roi_align", "forward") == 584
    assert op_flops(r, "torchvision._roi_align_backward", "backward") == 584


def test_roi_align_adaptive_sampling_reads_the_boxes():
    # sampling_ratio -1: a 6 wide, 3 high box in 2 x 2 bins samples ceil(3/2) x ceil(6/2) = 6 per bin:
    # 4 x (20 x 6 + 2 x (8 x 6 + 1)) = 4 x (120 + 98) = 872; on meta it needs the box, so the step runs on the CPU
    rois = torch.tensor([[0., 0, 0, 6, 3]])
    r = _align(rois, -1)
    assert op_flops(r, "torchvision.roi_align", "forward") == 872
    assert op_flops(_align(rois, -1, device="meta"), "torchvision.roi_align", "forward") == 872


def test_roi_pool_compares_every_element_of_each_bin():
    # box (0, 0)-(4, 2): 5 wide, 3 high; 2 x 2 bins: columns [0, 3) and [2, 5) (3 + 3), rows [0, 2) and [1, 3)
    # (2 + 2): 4 x 6 = 24 comparisons per channel, 2 channels: 48; backward 1 per grad element: 1 x 2 x 2 x 2 = 8
    rois = torch.tensor([[0., 0, 0, 4, 2]])
    fn = lambda x, w: torchvision.ops.roi_pool(x * w, rois.to(x.device), (2, 2), 1.0)  # noqa: E731
    r = flopcount.count(Fn(fn, (1,)), torch.randn(1, 2, 8, 8), device="cpu")
    assert op_flops(r, "torchvision.roi_pool", "forward") == 48
    assert op_flops(r, "torchvision._roi_pool_backward", "backward") == 8


def test_unique_on_floats_sorts_and_compares_neighbours():
    # 8 values: 8 x 3 + 7 = 31
    r = forward(lambda x, w: torch.unique(x * w), torch.randn(8), (1,), device="cpu")
    assert op_flops(r, "aten._unique2", "forward") == 31

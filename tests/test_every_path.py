"""The paths an outside check found untried: eval-mode detectors that fall back to the CPU, unbatched attention on
meta, recurrent layers as a CUDA run takes them, and a count that must not depend on torch's global random state.
Every expected value is a hand calculation or a real CPU run."""
import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F

from flopcount import count
from helpers import op_flops


class Attend(nn.Module):
    """Self-attention of its input with a parameter in front, so that backward runs the attention's gradient."""

    def __init__(self, **kwargs):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.kwargs = kwargs

    def forward(self, x):
        x = x * self.scale
        return F.scaled_dot_product_attention(x, x, x, **self.kwargs)


def by_op(report):
    f = report.frame
    return f[f.flops > 0].groupby(["op", "phase"])["flops"].sum()


# --- eval-mode detectors: the fallback to the CPU ----------------------------------------------------------------
@pytest.mark.parametrize("build", [
    lambda: torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None),
    lambda: torchvision.models.detection.fcos_resnet50_fpn(weights=None, weights_backbone=None, min_size=128,
                                                           max_size=128),
], ids=["fasterrcnn_mobilenet_v3_large_320_fpn", "fcos_resnet50_fpn"])
def test_an_eval_mode_detector_falls_back_to_the_cpu_and_equals_a_cpu_run(build):
    # on meta the anchor generator caches its anchors as meta tensors before NMS stops the step; the CPU run that
    # follows must not be handed them ("Cannot copy out of meta tensor")
    torch.manual_seed(0)
    model = build().eval()
    images = [torch.rand(3, 160, 160, generator=torch.Generator().manual_seed(1))]
    fallback = count(model, (images,), backward=False)
    real = count(model, (images,), backward=False, device="cpu")
    assert fallback.meta["device"] == "cpu" and "fallback" in fallback.meta
    assert fallback.total("forward") == real.total("forward") > 0
    assert by_op(fallback).equals(by_op(real))
    model(images)  # and the caller's model still runs for real


# --- unbatched (3-d) attention ----------------------------------------------------------------------------------
# (heads 4, L 128, E 64) = 65,536 scores. Forward per score QK^T 2E + softmax 5 + PV 2E = 261: 17,104,896.
# Backward per score 6E + 4E + 5 = 645 and 2E per query row (512 rows): 42,270,720 + 65,536 = 42,336,256.
UNBATCHED_FORWARD, UNBATCHED_BACKWARD = 65_536 * 261, 65_536 * 645 + 512 * 128


def test_unbatched_attention_on_meta_is_counted_as_on_the_cpu():
    x = torch.randn(4, 128, 64)
    no_grad = count(Attend(), x, backward=False)
    assert op_flops(no_grad, "aten._scaled_dot_product_flash_attention_for_cpu", "forward") == UNBATCHED_FORWARD
    assert not no_grad.uncounted
    meta, cpu = (count(Attend(), x, device=d) for d in ("meta", "cpu"))
    assert op_flops(meta, "aten._scaled_dot_product_flash_attention_for_cpu_backward", "backward") \
        == UNBATCHED_BACKWARD
    assert by_op(meta).equals(by_op(cpu))


def test_unbatched_attention_with_a_mask_equals_a_cpu_run():
    # a 2-d boolean mask: PyTorch lifts it to 4-d with the query, then makes it additive; +1 per score each way
    mask = torch.ones(128, 128, dtype=torch.bool).tril()
    x = torch.randn(4, 128, 64)
    meta, cpu = (count(Attend(attn_mask=mask), x, device=d) for d in ("meta", "cpu"))
    assert op_flops(meta, "aten._scaled_dot_product_flash_attention_for_cpu", "forward") \
        == UNBATCHED_FORWARD + 65_536
    assert by_op(meta).equals(by_op(cpu))


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "aten._scaled_dot_product_flash_attention"),
                                          (torch.float32, "aten._scaled_dot_product_efficient_attention")])
def test_unbatched_attention_as_cuda_takes_the_fused_kernel(dtype, kernel):
    # on a GPU PyTorch adds the batch dimension before choosing: flash for bf16, memory-efficient for fp32
    r = count(Attend(), torch.randn(4, 128, 64, dtype=dtype), as_device="cuda")
    assert op_flops(r, kernel, "forward") == UNBATCHED_FORWARD
    assert op_flops(r, kernel + "_backward", "backward") == UNBATCHED_BACKWARD
    assert op_flops(r, "aten.bmm", "forward") == 0 and not r.uncounted


# --- recurrent layers as a CUDA run takes them: one cuDNN op for the stack ----------------------------------------
def test_lstm_as_cuda_is_one_cudnn_op():
    # nn.LSTM(4, 5) on 3 steps x 2 sequences = 6 tokens; G = 4 gates, H = 5, I = 4, GH = 20.
    # forward per token: projections 2 GH (I + H) = 360, their sum GH = 20, two biases 2 GH = 40, cell 18 H = 90:
    # 510 -> 3060. backward per token: data gradients 360, weight gradients 360, bias gradients 40, the gates'
    # sum 20, the cell's derivative 2 x 90 = 180: 960 -> 5760
    r = count(nn.LSTM(4, 5), torch.randn(3, 2, 4), as_device="cuda")
    assert op_flops(r, "aten._cudnn_rnn", "forward") == 3060
    assert op_flops(r, "aten._cudnn_rnn_backward", "backward") == 5760
    assert op_flops(r, "aten.addmm", "forward") == op_flops(r, "aten.mm", "backward") == 0
    assert not r.uncounted


def test_gru_layers_and_directions_as_cuda():
    # nn.GRU(4, 5, 2 layers, bidirectional, batch first) on 2 x 3 = 6 tokens; G = 3, GH = 15; cell 15 H = 75.
    # per token and direction, forward 2 GH (I + H) + GH + 2 GH + 75: layer 0 (I = 4) 270 + 15 + 30 + 75 = 390,
    # layer 1 (I = 10) 450 + 120 = 570; 2 directions: 6 x 2 x (390 + 570) = 11520
    r = count(nn.GRU(4, 5, num_layers=2, bidirectional=True, batch_first=True), torch.randn(2, 3, 4),
              as_device="cuda")
    assert op_flops(r, "aten._cudnn_rnn", "forward") == 11520
    assert not r.uncounted


# --- run to run: a count must not depend on torch's global random state -------------------------------------------
def _small_keypoint_rcnn():
    from torchvision.models.detection import KeypointRCNN
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
    from torchvision.models.detection.keypoint_rcnn import KeypointRCNNHeads, KeypointRCNNPredictor

    torch.manual_seed(0)
    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5)
    return KeypointRCNN(backbone, num_classes=2, min_size=128, max_size=128,
                        keypoint_head=KeypointRCNNHeads(256, (16,)), keypoint_predictor=KeypointRCNNPredictor(16, 5),
                        box_batch_size_per_image=32, rpn_batch_size_per_image=32)


@pytest.mark.slow
def test_a_detector_that_samples_in_training_counts_the_same_whatever_the_global_seed():
    # in training the R-CNN heads sample their proposals (torch.randperm): which ones are kept decides which
    # keypoints are valid, and so the loss's work. Unseeded, the three counts below differed.
    from flopcount.model.vision import detection_batch

    model = _small_keypoint_rcnn()
    _, targets = detection_batch(model, (3, 128, 128), 1, "cpu")
    images = [torch.rand(3, 128, 128, generator=torch.Generator().manual_seed(0))]
    totals = set()
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        r = count(model, (images, targets))
        totals.add((r.total("forward"), r.total("backward")))
        assert torch.equal(torch.get_rng_state(), state)  # the caller's random stream is left where it was
    assert len(totals) == 1


def test_a_count_draws_from_its_own_random_stream():
    # dropout draws random numbers on a real device: the caller's generator must not move, and the count must
    # not depend on where it stood
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(2, 8)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a = count(model, x, device="cpu")
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(6)
    b = count(model, x, device="cpu")
    assert a.total() == b.total() > 0

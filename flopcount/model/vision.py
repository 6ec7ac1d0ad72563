"""torchvision's models by name, every family: how each is built and what it is fed.

Built with ``weights=None`` and, where the builder takes one, ``weights_backbone=None`` (torchvision would
otherwise fetch an ImageNet backbone for a segmentation or detection model), and ``quantize=False`` for the
quantizable classifiers (their float form, which trains). Nothing is downloaded: the weights enums are read only
for their metadata (crop size, published operation count), which ships with torchvision.

Default input per family (per sample):

* classification: 3 x S x S, S = 224 where any of the model's torchvision weights is evaluated at 224, else the
  crop size of its weights (299 for inception_v3, 600 for efficientnet_b7, 384 for efficientnet_v2_s);
* segmentation: 3 x 520 x 520 (torchvision's evaluation size);
* detection: a list of images of 3 x M x M, M the model's own ``transform.min_size`` (800 for the R-CNNs,
  RetinaNet and FCOS, 320 and 300 for the SSDs), with generated training targets per image: boxes, labels, and
  masks (Mask R-CNN) or keypoints (Keypoint R-CNN) where the model needs them;
* video: 3 x 16 frames x S x S, S the crop size of its weights (112 or 224);
* optical flow: two frames of 3 x 512 x 512 (the size of the operation counts torchvision publishes for RAFT).
"""
from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch

FAMILIES = ("classification", "segmentation", "detection", "video", "optical_flow", "quantization")
SEGMENTATION_SIZE = 520
VIDEO_FRAMES = 16
FLOW_SHAPE = (3, 512, 512)
BOXES_PER_IMAGE = 4


def builder(name: str):
    """torchvision's builder of the model ``name``, or None where torchvision has no model of that name."""
    import torchvision.models as tvm

    try:
        return tvm.get_model_builder(name)
    except ValueError:
        return None


def family(name: str) -> Optional[str]:
    """The torchvision family of model ``name`` (``classification``, ``detection``, ...), or None."""
    import torchvision.models as tvm

    try:
        builder = tvm.get_model_builder(name)
    except ValueError:
        return None
    module = builder.__module__
    for fam in FAMILIES[1:]:
        if f".{fam}" in module:
            return fam
    return "classification"


def builder_kwargs(builder, num_classes: Optional[int] = None) -> dict:
    """The keyword arguments that build a torchvision model without any weights (and with ``num_classes``)."""
    params = inspect.signature(builder).parameters
    kwargs = {"weights": None}
    if "weights_backbone" in params:
        kwargs["weights_backbone"] = None
    if "quantize" in params:
        kwargs["quantize"] = False
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    return kwargs


def weights_entries(name: str) -> list:
    """The torchvision weights enums of model ``name``."""
    import torchvision.models as tvm

    try:
        return list(tvm.get_model_weights(name))
    except (ValueError, KeyError):
        return []


def crop_size(weights) -> Optional[int]:
    """The crop size of a torchvision weights entry's transforms, or None."""
    keywords = getattr(weights.transforms, "keywords", None) or {}
    crop = keywords.get("crop_size")
    if isinstance(crop, (tuple, list)):
        crop = crop[0]
    return int(crop) if crop else None


def image_size(name: str) -> Optional[int]:
    """The side a classifier or video model is evaluated at, from its weights' transforms (224 preferred)."""
    crops = [c for c in (crop_size(w) for w in weights_entries(name)) if c]
    if not crops:
        return None
    return 224 if 224 in crops else crops[0]


def sample_shape(name: str, model=None) -> Optional[Tuple[int, ...]]:
    """The shape of one sample of torchvision model ``name``'s input, from its family and weights, or None."""
    fam = family(name)
    if fam in ("classification", "quantization"):
        side = image_size(name)
        return (3, side, side) if side else None
    if fam == "segmentation":
        return (3, SEGMENTATION_SIZE, SEGMENTATION_SIZE)
    if fam == "video":
        side = image_size(name) or 112
        return (3, VIDEO_FRAMES, side, side)
    if fam == "optical_flow":
        return FLOW_SHAPE
    if fam == "detection":
        side = max(getattr(getattr(model, "transform", None), "min_size", (800,)))
        return (3, int(side), int(side))
    return None


def _num_classes(model) -> int:
    for attr in ("roi_heads.box_predictor.cls_score", "head.classification_head.num_classes",
                 "head.classification_head.cls_logits"):
        obj = model
        for part in attr.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, int):
            return obj
        if isinstance(obj, torch.nn.Linear):
            return obj.out_features
    return 91  # COCO's label count, torchvision's default


def _keypoints(model) -> int:
    predictor = getattr(getattr(model, "roi_heads", None), "keypoint_predictor", None)
    if predictor is None:
        return 0
    return int(getattr(predictor, "out_channels", 17))


def detection_batch(model, shape, batch: int, device: str, dtype=torch.float32):
    """(images, targets): ``batch`` images of ``shape`` on ``device`` and, for each, generated targets with real
    values (a detector matches its anchors against the boxes' values): BOXES_PER_IMAGE boxes inside the image,
    labels in [1, classes), masks or keypoints where the model has heads for them."""
    gen = torch.Generator().manual_seed(0)
    _, h, w = shape
    classes = max(_num_classes(model), 2)
    keypoints = _keypoints(model)
    masks = getattr(getattr(model, "roi_heads", None), "mask_predictor", None) is not None
    images = [torch.empty(shape, device=device, dtype=dtype) for _ in range(batch)]
    targets = []
    for _ in range(batch):
        n = BOXES_PER_IMAGE
        xy = torch.rand(n, 2, generator=gen) * torch.tensor([w * 0.6, h * 0.6])
        wh = (torch.rand(n, 2, generator=gen) * 0.3 + 0.1) * torch.tensor([w, h])
        boxes = torch.cat([xy, xy + wh], 1).to(dtype)
        t = {"boxes": boxes, "labels": torch.randint(1, classes, (n,), generator=gen)}
        if masks:
            t["masks"] = torch.zeros(n, h, w, dtype=torch.uint8)
            for i, (x1, y1, x2, y2) in enumerate(boxes.round().to(torch.int64).tolist()):
                t["masks"][i, y1:y2, x1:x2] = 1
        if keypoints:
            kx = boxes[:, None, 0] + torch.rand(n, keypoints, generator=gen) * (boxes[:, None, 2] - boxes[:, None, 0])
            ky = boxes[:, None, 1] + torch.rand(n, keypoints, generator=gen) * (boxes[:, None, 3] - boxes[:, None, 1])
            t["keypoints"] = torch.stack([kx, ky, torch.ones_like(kx)], 2).to(dtype)
        targets.append(t)
    return images, targets


def example_batch(name: str, model, batch: int, shape, device: str, dtype=torch.float32):
    """The batch a torchvision model of ``name``'s family is fed, or None for a single image tensor."""
    fam = family(name)
    if fam == "detection":
        return detection_batch(model, tuple(shape), batch, device, dtype)
    if fam == "optical_flow":
        frames = tuple(torch.empty((batch,) + tuple(shape), device=device, dtype=dtype) for _ in range(2))
        return frames
    return None

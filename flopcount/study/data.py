"""The images of the epoch pass: CIFAR-10 where it is on disk (never downloaded), else generated images."""
from __future__ import annotations

from flopcount.study.config import StudyConfig


class GeneratedImages:
    """``n`` images of ``shape``, each drawn from its own seed (so any subset is reproducible), label = index mod C.

    Made on demand: 10,000 images of 3x224x224 would be 6 GB held at once.
    """

    def __init__(self, n: int, shape=(3, 224, 224), num_classes: int = 10, seed: int = 0):
        self.n, self.shape, self.num_classes, self.seed = int(n), tuple(shape), int(num_classes), int(seed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch

        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed + i)
        return torch.rand(self.shape, generator=g), i % self.num_classes


def make_dataset(config: StudyConfig):
    """(dataset, description): the CIFAR-10 test set resized to the image shape if ``data_root`` holds it, else
    generated images of the same shape and count."""
    n = int(config.images)
    why = "no --data-root given"
    if config.data_root:
        try:
            import torch
            from torchvision import datasets, transforms

            tf = transforms.Compose([transforms.Resize(tuple(config.image_shape[1:])), transforms.ToTensor()])
            ds = datasets.CIFAR10(config.data_root, train=False, download=False, transform=tf)
            if len(ds) > n:
                ds = torch.utils.data.Subset(ds, range(n))
            side = "x".join(str(s) for s in config.image_shape[1:])
            return ds, f"CIFAR-10 test set from {config.data_root}, first {len(ds)} images, resized to {side}"
        except Exception as exc:  # not there, or not CIFAR-10: fall back, and say so
            why = f"CIFAR-10 not found under {config.data_root} ({type(exc).__name__})"
    shape = "x".join(str(s) for s in config.image_shape)
    return GeneratedImages(n, config.image_shape, config.num_classes), (
        f"generated images ({why}): {n} random images of {shape}, {config.num_classes} classes"
    )

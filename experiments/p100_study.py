"""Reproduce the 2021 P100 utilization study (Epoch AI, "How to measure FLOP/s for Neural Networks empirically?").

The study's configuration: the 13 torchvision models, 3x224x224 inputs, 10 classes (CIFAR-10), batch sizes 1, 64
and 128, the 10,000 CIFAR-10 test images. Every option of `flopcount study` applies:

    python -m experiments.p100_study --quick --out results/quick
    python -m experiments.p100_study --data-root ~/data --out results/p100
"""
from __future__ import annotations

import sys

from flopcount.model.specs import STUDY_MODELS
from flopcount.study import StudyConfig

STUDY = StudyConfig(models=STUDY_MODELS, batch_sizes=(1, 64, 128), images=10_000, num_classes=10,
                    image_shape=(3, 224, 224), methods=("theory", "one", "batch", "epoch"))


def main(argv=None) -> int:
    from flopcount import cli

    # `flopcount study` runs the same grid: the package's StudyConfig defaults are STUDY (a test keeps them equal).
    return cli.main(["study", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

"""What the 2021 P100 study published: the figures a run of the study is set beside."""
from __future__ import annotations

# The published figures (the same as data/p100_study_published.csv, which gives the source; a test keeps them equal).
PUBLISHED = {
    "source": 'Hobbhahn, Epoch AI (2021), "How to measure FLOP/s for Neural Networks empirically?", '
              "https://epochai.org/blog/measure-FLOPs-empirically",
    "device": "Tesla P100 (PCIe, 16 GB)",
    "peak_fp32": 9.3e12,
    "utilization_most": (0.3, 0.75),
    "utilization_outliers": ("mobilenet_v2", "efficientnet_b0"),
    "utilization_outliers_below": 0.04,
    "backward_to_forward": 2.0,
}

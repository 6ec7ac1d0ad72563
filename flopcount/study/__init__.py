"""The P100 study: reproduce the 2021 utilization study (Epoch AI, "How to measure FLOP/s for Neural Networks
empirically?") on whatever device is here, and say what matches it and why.

One module per question: ``config`` (what to run), ``data`` (the images of the epoch pass), ``backend`` (the real
counting, timing and peak), ``store`` (the resumable files and ``StudyResult``), ``grid`` (the rows: which, in what
order, and how each is filled), ``report`` and ``findings`` (figures, tables, REPORT.md and its verdicts).
The backward:forward analysis it uses is not study-specific: ``flopcount.base.ratios``.
"""
from flopcount.study.backend import TorchBackend
from flopcount.study.config import NVTX_METHODS, QUICK, TIME_METHODS, StudyConfig, StudyError, study_config
from flopcount.study.data import GeneratedImages, make_dataset
from flopcount.study.grid import Task, plan, run_study
from flopcount.study.published import PUBLISHED
from flopcount.study.report import render_report, tables, write_figures
from flopcount.study.store import COLUMNS, KEY, ResultsFile, StudyResult

__all__ = [
    "run_study", "study_config", "StudyConfig", "QUICK", "StudyResult", "StudyError", "TorchBackend",
    "GeneratedImages", "make_dataset", "PUBLISHED", "TIME_METHODS", "NVTX_METHODS", "Task", "plan", "ResultsFile",
    "COLUMNS", "KEY", "render_report", "tables", "write_figures",
]

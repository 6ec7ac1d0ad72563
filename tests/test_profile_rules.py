"""Two rules of the profile readers, each on a trace written here whose answer changes when the rule does.

* The backward-thread vote (``kineto_trace._keyed_seq``): a backward node names its forward thread by the
  profiler's own number (``Fwd thread id``), not an OS thread id, so it is tied to the forward thread whose ops
  carry most of that number's sequence numbers. Two forward threads here share some sequence numbers; only the
  majority finds each node's forward convolution, whose output size (and so FLOPs) comes from the node.
* The naive count (the 2021 study's): every kernel takes the FLOPs of every enclosing range that has a formula,
  and an op without kernels counts 0.
"""
import json

import pytest

from flopcount.profiles import analyze_trace

CONV_TYPES = ["float", "float", "", "ScalarList", "ScalarList", "ScalarList", "Scalar", "ScalarList", "Scalar"]


def _ev(name, ts, dur, tid, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _conv(ts, tid, seq, side):
    # no Concrete Inputs: the output size can only come from the linked backward node
    return _ev("aten::convolution", ts, 5, tid, **{"Input Dims": [[1, 1, side, side], [2, 1, 3, 3]] + [[]] * 7,
                                                   "Input type": CONV_TYPES, "Sequence number": seq,
                                                   "Fwd thread id": 0})


def _node(ts, seq, fwd, side):
    out = side - 2
    return _ev("ConvolutionBackward0", ts, 5, 30, **{"Input Dims": [[1, 2, out, out]], "Input type": ["float"],
                                                     "Sequence number": seq, "Fwd thread id": fwd})


@pytest.fixture
def two_threads(tmp_path):
    """Thread 10 (profiler number 1): five convolutions of an 8x8 image, seq 0-4; thread 20 (number 2): three of a
    10x10 image, seq 3-5. Nodes of number 1 carry seq 0-4 (votes: thread 10 five, thread 20 two), nodes of
    number 2 seq 3-5 (thread 10 two, thread 20 three)."""
    ev = [_conv(100 + 10 * s, 10, s, 8) for s in range(5)] + [_conv(100 + 10 * s, 20, s, 10) for s in (3, 4, 5)]
    ev += [_node(1000 + 10 * s, s, 1, 8) for s in range(5)] + [_node(2000 + 10 * s, s, 2, 10) for s in (3, 4, 5)]
    path = tmp_path / "two_threads.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return path


def test_backward_nodes_tied_to_their_forward_thread_by_the_vote(two_threads):
    """Hand-worked: a 3x3, 1 -> 2 channel convolution is 2 * out positions * 18: on 8x8 (6x6 out) 1296, on 10x10
    (8x8 out) 2304; all eight linked: 5 * 1296 + 3 * 2304 = 13,392, and none left underived."""
    a = analyze_trace(two_threads)
    assert a.report.total("forward") == 5 * 1296 + 3 * 2304
    assert not [n for n in a.notes if "not derived" in n]


def _gpu_step(tmp_path):
    conv_args = {"Input Dims": [[1, 1, 8, 8], [2, 1, 3, 3]] + [[]] * 7, "Input type": CONV_TYPES,
                 "Concrete Inputs": ["", "", "", "[1, 1]", "[0, 0]", "[1, 1]", "False", "[0, 0]", "1"]}
    conv_inner = {"Input Dims": [[1, 1, 8, 8], [2, 1, 3, 3]] + [[]] * 11,
                  "Input type": CONV_TYPES + ["Scalar"] * 4,
                  "Concrete Inputs": conv_args["Concrete Inputs"] + ["False", "False", "True", "True"]}
    cudnn = {"Input Dims": [[1, 1, 8, 8], [2, 1, 3, 3]] + [[]] * 7,
             "Input type": ["float", "float", "ScalarList", "ScalarList", "ScalarList", "Scalar", "Scalar",
                            "Scalar", "Scalar"],
             "Concrete Inputs": ["", "", "[0, 0]", "[1, 1]", "[1, 1]", "1", "False", "False", "True"]}
    ev = [_ev("aten::convolution", 100, 50, 1, **conv_args), _ev("aten::_convolution", 105, 40, 1, **conv_inner),
          _ev("aten::cudnn_convolution", 110, 30, 1, **cudnn),
          _ev("cudaLaunchKernel", 112, 2, 1, cat="cuda_runtime", correlation=1),
          _ev("cudaLaunchKernel", 120, 2, 1, cat="cuda_runtime", correlation=2),
          _ev("aten::relu", 200, 10, 1, **{"Input Dims": [[1, 2, 6, 6]], "Input type": ["float"]}),
          _ev("aten::addmm", 300, 20, 1, **{"Input Dims": [[3], [4, 5], [5, 3], [], []],
                                            "Input type": ["float", "float", "float", "Scalar", "Scalar"],
                                            "Concrete Inputs": ["", "", "", "1", "1"]}),
          _ev("cudaLaunchKernel", 305, 2, 1, cat="cuda_runtime", correlation=3)]
    ev += [_ev(f"kernel_{c}", 500 + 20 * c, 10, 7, cat="kernel", correlation=c, device=0, stream=7) for c in (1, 2, 3)]
    path = tmp_path / "gpu_step.json"
    path.write_text(json.dumps({"traceEvents": ev, "deviceProperties": [{"id": 0, "name": "test GPU"}]}))
    return path


def test_naive_count_every_kernel_times_every_enclosing_formula(tmp_path):
    """Hand-worked: the convolution (6x6 out, 2 channels, 3x3x1 weight) is 2*36*18 = 1296, priced by each of its
    three nested ranges (convolution, _convolution, cudnn_convolution), each enclosing both kernels: naive 3 * 2 *
    1296 = 7776; addmm (4,5)@(5,3) + bias 120 + 12 = 132 with one kernel: 132; relu (72 elements) launched no
    kernel: naive 0. De-duplicated: 1296 + 72 + 132 = 1500."""
    a = analyze_trace(_gpu_step(tmp_path))
    naive = a.ops.groupby("op")["naive_flops"].sum()
    conv = naive.reindex(["aten.convolution", "aten._convolution", "aten.cudnn_convolution"], fill_value=0)
    assert conv.tolist() == [2592, 2592, 2592]
    assert naive["aten.addmm"] == 132
    ops = a.ops.set_index("op")
    assert ops.loc["aten.relu", "naive_flops"] == 0 and ops.loc["aten.relu", "flops"] == 72
    assert a.ops["naive_flops"].sum() == 7776 + 132
    assert a.report.total() == 1296 + 72 + 132
    assert analyze_trace(_gpu_step(tmp_path), naive=True).report.total() == 7776 + 132


def test_argument_rules_come_from_the_formula_table():
    """The profiles keep no op-name lists of their own: which rule an op's missing arguments follow is the
    formula table's (formulas/roles.py)."""
    import inspect

    from flopcount.formulas import roles
    from flopcount.profiles import marker_args

    assert roles.role("aten::cudnn_convolution") == roles.role("aten.convolution") == "conv"
    assert roles.role("aten.max_pool2d_with_indices") == "max_pool"
    assert roles.role("aten._scaled_dot_product_efficient_attention") == "attention"
    assert roles.role("aten.add") == ""
    src = inspect.getsource(marker_args)
    assert "cudnn_convolution" not in src and "max_pool2d" not in src and "native_batch_norm" not in src

"""Which forward op a backward node's sizes belong to (``marker_flops.op_flops``), on a trace written here.

An op run under ``no_grad`` records the sequence number the next autograd node will take, and makes no node. When
the next range to take that number is no priced op (a custom autograd Function: FSDP2's
``RegisterPostBackwardFunction``), the no_grad op must stay unlinked: linked, it would take the Function's node's
sizes as its own output. That was a reader bug, found on a real FSDP2 run, where the rotary embedding's
``cos * attention_scaling`` (1 x 16 x 8, under no_grad) was priced on the next layer's 1 x 16 x 64 activations:
1,024 FLOPs instead of 128.
"""
import json

from flopcount.profiles import analyze_trace

CONV_TYPES = ["float", "float", "", "ScalarList", "ScalarList", "ScalarList", "Scalar", "ScalarList", "Scalar"]


def _ev(name, ts, dur, tid, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace(tmp_path):
    """Forward thread 10 (profiler number 1): a convolution (seq 7: it makes node 7), the no_grad mul (seq 8,
    makes nothing) and the custom Function that takes number 8. Backward thread 30: node 7 (the convolution's,
    its output's gradient 1 x 2 x 6 x 6) and node 8 (the Function's, 1 x 16 x 64)."""
    ev = [
        # no Concrete Inputs: the convolution's output size can come only from its node (the link still works)
        _ev("aten::convolution", 100, 10, 10, **{"Input Dims": [[1, 1, 8, 8], [2, 1, 3, 3]] + [[]] * 7,
                                                 "Input type": CONV_TYPES, "Sequence number": 7}),
        _ev("aten::mul", 200, 10, 10, **{"Input Dims": [[1, 16, 8], []], "Input type": ["float", "double"],
                                         "Sequence number": 8}),
        _ev("RegisterPostBackwardFunction", 300, 10, 10, **{"Input Dims": [[1, 16, 64]], "Input type": ["float"],
                                                            "Sequence number": 8}),
        _ev("RegisterPostBackwardFunctionBackward", 1000, 10, 30, **{
            "Input Dims": [[1, 16, 64]], "Input type": ["float"], "Sequence number": 8, "Fwd thread id": 1}),
        _ev("ConvolutionBackward0", 1100, 10, 30, **{
            "Input Dims": [[1, 2, 6, 6]], "Input type": ["float"], "Sequence number": 7, "Fwd thread id": 1}),
    ]
    path = tmp_path / "no_grad_op.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return path


def test_a_no_grad_op_is_not_linked_to_the_node_a_later_function_makes(tmp_path):
    """By hand: the mul multiplies each of its 1 * 16 * 8 = 128 elements once by a scalar: 128 FLOPs (linked to
    node 8 it read 1 * 16 * 64 = 1,024). The convolution, 3 x 3 x 1 -> 2 channels over a 6 x 6 output, is
    2 * (2 * 36) * 9 = 1,296 FLOPs, its output size taken from node 7: the right link is kept."""
    a = analyze_trace(_trace(tmp_path))
    ops = a.op_ranges.set_index("op")
    assert ops.loc["aten.mul", "flops"] == 1 * 16 * 8
    assert ops.loc["aten.convolution", "flops"] == 2 * (2 * 6 * 6) * (1 * 3 * 3)
    assert a.report.total("forward") == 128 + 1296
    assert not [n for n in a.notes if "not derived" in n]


def test_the_node_of_an_unpriced_range_gives_no_forward_op_to_a_backward_op(tmp_path):
    """A backward op under node 8 has no forward op to read facts from (the Function made the node, not the
    no_grad mul), and is priced from its own sizes. By hand: (1 x 16 x 64) x (1 x 16 x 64) elementwise is 1,024
    FLOPs; the forward stays 128 + 1,296."""
    path = _trace(tmp_path)
    doc = json.loads(path.read_text())
    doc["traceEvents"].append(_ev("aten::mul", 1002, 5, 30, **{"Input Dims": [[1, 16, 64], [1, 16, 64]],
                                                                "Input type": ["float", "float"]}))
    path.write_text(json.dumps(doc))
    a = analyze_trace(path)
    assert a.report.total("backward") == 1 * 16 * 64
    assert a.report.total("forward") == 128 + 1296

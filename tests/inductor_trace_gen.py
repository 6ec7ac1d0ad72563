"""A small GPU-style torch.profiler trace of a compiled training step, written by hand in the format Inductor and
the profiler use (see flopcount/profiles/compiled.py for where PyTorch defines it).

* ``CompiledFunction`` (forward) on the main thread, ``CompiledFunctionBackward`` on the autograd thread: cpu_op
  ranges, as the profiler records an autograd function and its backward node;
* Inductor's launch records: cpu_op events named after the generated kernel, enclosing the runtime launch, whose
  args carry ``kernel_flop`` and ``kernel_num_gb`` (``CachingAutotuner.get_profiler_kwargs``) where the kernel was
  compiled with ``config.benchmark_kernel``; one kernel carries them on its own ``kernel`` event instead (as
  ``profile_analysis.augment_trace`` writes them);
* an extern matmul (``aten::mm``) inside the region, priced by flopcount's formula;
* a second compiled region whose one kernel carries no figures (uncounted, listed under the region);
* ``aten::_fused_adam_`` under ``Optimizer.step#Adam.step``, with its scalars in ``Concrete Inputs``;
* an fbgemm embedding op (no formula: listed with its calls and time).

Every time is in microseconds; the kernels' durations are chosen so the shares are easy to work by hand.
"""
import itertools
import json

MAIN, AUTOGRAD, STREAM = 100, 200, 7

# (correlation, kernel name, duration us, args on the kernel event)
KERNELS = [
    (1, "triton_poi_fused_add_relu_0", 4, {}),
    (2, "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8_stage3", 8, {}),
    (3, "triton_red_fused_sum_1", 3, {}),
    (4, "triton_poi_fused_threshold_backward_2", 2, {"kernel_flop": 2048, "kernel_num_gb": 1.6e-5}),
    (5, "triton_tem_fused_mm_3", 6, {}),
    (6, "triton_poi_fused_mul_4", 5, {}),
    (7, "void multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", 10, {}),
    (8, "void split_embedding_codegen_forward_unweighted_kernel<float>", 7, {}),
]
# hand-worked: kernel 1: 4096 (its record); mm (64,32)@(32,16) = 2*64*32*16 = 65,536; kernel 4: 2048 (its event);
# kernel 5: 65,536 (its record); Adam: 110 elements x (13 + 2 for weight decay) = 1,650
FORWARD_FLOPS = 4096 + 65_536
BACKWARD_FLOPS = 2048 + 65_536
ADAM_FLOPS = 110 * 15
TOTAL_US = 4 + 8 + 3 + 2 + 6 + 5 + 10 + 7  # 45
COUNTED_US = 4 + 8 + 2 + 6 + 10  # 30
UNCOUNTED_REGION_US = 3 + 5  # the two CompiledFunction kernels without figures
UNCOUNTED_FBGEMM_US = 7


_IDS = itertools.count(1)


def _op(name, ts, dur, tid=MAIN, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": next(_IDS), **args}}


def _launch(corr, ts, tid=MAIN):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cuLaunchKernel", "pid": 1, "tid": tid, "ts": ts, "dur": 1,
            "args": {"correlation": corr}}


def events():
    ev = []
    t = 1000
    # forward region: Inductor record with figures, extern mm, record without figures
    ev.append(_op("CompiledFunction", t, 100, **{"Sequence number": 5, "Fwd thread id": 0}))
    ev.append(_op("triton_poi_fused_add_relu_0", t + 10, 10, kernel_flop=4096, kernel_num_gb=4.9e-5,
                  kernel_backend="triton", kernel_file="cab12xyz.py"))
    ev.append(_launch(1, t + 12))
    ev.append(_op("aten::mm", t + 30, 20, **{"Input Dims": [[64, 32], [32, 16]], "Input type": ["float", "float"],
                                             "Concrete Inputs": ["", ""]}))
    ev.append(_launch(2, t + 35))
    ev.append(_op("triton_red_fused_sum_1", t + 60, 10, kernel_backend="triton"))
    ev.append(_launch(3, t + 62))
    # backward region on the autograd engine's thread
    t = 2000
    ev.append(_op("CompiledFunctionBackward", t, 100, tid=AUTOGRAD, **{"Sequence number": 5, "Fwd thread id": 1}))
    ev.append(_op("triton_poi_fused_threshold_backward_2", t + 10, 10, tid=AUTOGRAD, kernel_backend="triton"))
    ev.append(_launch(4, t + 12, AUTOGRAD))
    ev.append(_op("triton_tem_fused_mm_3", t + 30, 10, tid=AUTOGRAD, kernel_flop=65_536, kernel_num_gb=1.3e-5,
                  kernel_backend="triton"))
    ev.append(_launch(5, t + 32, AUTOGRAD))
    # a second compiled graph whose kernels carry no figures
    t = 3000
    ev.append(_op("CompiledFunction", t, 50, **{"Sequence number": 6, "Fwd thread id": 0}))
    ev.append(_op("triton_poi_fused_mul_4", t + 10, 10, kernel_backend="triton"))
    ev.append(_launch(6, t + 12))
    # the fused optimizer: two parameters (10x10 and 10), weight decay 0.01
    t = 4000
    ev.append({"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#Adam.step", "pid": 1, "tid": MAIN,
               "ts": t, "dur": 100, "args": {}})
    p = [[10, 10], [10]]
    ev.append(_op("aten::_fused_adam_", t + 10, 50, **{
        "Input Dims": [p, p, p, p, [], [[], []], [], [], [], [], [], [], [], [], []],
        "Input type": ["TensorList"] * 6 + ["Scalar"] * 7 + ["", ""],
        "Concrete Inputs": ["", "", "", "", "", "", "0.001", "0.9", "0.999", "0.01", "1e-08", "False", "False",
                            "", ""]}))
    ev.append(_launch(7, t + 20))
    # an fbgemm embedding lookup: no formula
    t = 5000
    ev.append(_op("fbgemm::split_embedding_codegen_lookup_sgd_function", t, 30,
                  **{"Input Dims": [[96000], [61072], [8193]], "Input type": ["float", "long", "long"]}))
    ev.append(_launch(8, t + 5))
    # the device: each kernel 50 us after its launch
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in ev if e["cat"] == "cuda_runtime"}
    # a kernel carries the External id of the op it was launched in, as Kineto links them (each launch here
    # follows the op that makes it)
    launcher = {e["args"]["correlation"]: before["args"]["External id"] for before, e in zip(ev, ev[1:])
                if e["cat"] == "cuda_runtime"}
    for corr, name, dur, extra in KERNELS:
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": STREAM, "ts": launch_ts[corr] + 50,
                   "dur": dur, "args": {"correlation": corr, "External id": launcher[corr], "device": 0,
                                                "stream": STREAM, **extra}})
    return ev


def write(path):
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA A100-SXM4-80GB"}],
           "traceEvents": events()}
    with open(path, "w") as fh:
        json.dump(doc, fh)
    return path

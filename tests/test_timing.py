"""The timer's logic with a fake clock and a fake CUDA event API: no GPU, no wall-clock assertions."""
import pytest
import torch

from flopcount.base.errors import FlopcountError, oom_as_error
from flopcount.model.step import make_train_step
from flopcount.device.timing import Measurement, OutOfMemory, TimingError, time_epoch, time_step


class FakeClock:
    """perf_counter stand-in: each step() advances it by the next of ``durations``."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def stepper(clock, durations):
    it = iter(durations)
    calls = []

    def step():
        calls.append(1)
        clock.now += next(it)

    step.calls = calls
    return step


def test_cpu_warmup_excluded_and_median_taken():
    clock = FakeClock()
    # two slow warm-up steps (10 s, 5 s) then five timed ones
    step = stepper(clock, [10.0, 5.0, 0.3, 0.1, 0.2, 0.9, 0.2])
    t = time_step(step, device="cpu", steps=5, warmup=2, clock=clock)
    assert isinstance(t, Measurement)
    assert len(step.calls) == 7
    assert t.times == pytest.approx([0.3, 0.1, 0.2, 0.9, 0.2])
    assert t.median == pytest.approx(0.2)  # sorted: 0.1 0.2 0.2 0.3 0.9
    # quartiles of 0.1 0.2 0.2 0.3 0.9 (inclusive): 0.2 and 0.3 -> IQR 0.1
    assert (t.q1, t.q3, t.iqr) == pytest.approx((0.2, 0.3, 0.1))
    assert t.runs == 5 and t.min == pytest.approx(0.1)
    assert (t.warmup, t.steps) == (2, 5)


def test_even_number_of_steps_median_is_the_mean_of_the_middle_two():
    clock = FakeClock()
    t = time_step(stepper(clock, [1.0, 2.0, 4.0, 3.0]), device="cpu", steps=4, warmup=0, clock=clock)
    assert t.median == pytest.approx(2.5)


class FakeCuda:
    """The CUDA API surface the timer uses. Each recorded event gets the GPU time at that point in the stream;
    reading elapsed time before a synchronize() that follows the record raises, as the real API does for an
    event that has not completed."""

    def __init__(self):
        self.gpu_time_ms = 0.0
        self.log = []
        self.synced_at = -1
        outer = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing, "events must be created with enable_timing=True"
                self.t = None
                self.recorded_at = None

            def record(self, stream=None):
                self.t = outer.gpu_time_ms
                self.recorded_at = len(outer.log)
                outer.log.append("record")

            def elapsed_time(self, other):
                for ev in (self, other):
                    if ev.t is None or outer.synced_at < ev.recorded_at:
                        raise RuntimeError("event read before synchronize")
                outer.log.append("elapsed")
                return other.t - self.t

        self.Event = Event

    def synchronize(self):
        self.synced_at = len(self.log)
        self.log.append("sync")

    def empty_cache(self):
        self.log.append("empty_cache")


def gpu_stepper(cuda, durations_ms):
    it = iter(durations_ms)

    def step():
        cuda.log.append("step")
        cuda.gpu_time_ms += next(it)

    return step


def test_cuda_events_synchronised_before_reading_and_warmup_excluded():
    cuda = FakeCuda()
    step = gpu_stepper(cuda, [50.0, 40.0, 3.0, 2.0, 4.0])

    def host_clock():
        raise AssertionError("the host clock must not time GPU work")

    t = time_step(step, device="cuda", steps=3, warmup=2, cuda=cuda, clock=host_clock)
    assert t.times == pytest.approx([0.003, 0.002, 0.004])  # ms -> s, warm-up's 50 and 40 ms left out
    assert t.median == pytest.approx(0.003)
    assert t.clock == "cuda events"
    log = cuda.log
    # warm-up, then a sync so that warm-up work cannot leak into the first timed step
    assert log[:3] == ["step", "step", "sync"]
    # the timed steps run back to back between records, with no host stall
    assert log[3:10] == ["record", "step", "record", "step", "record", "step", "record"]
    assert log[10] == "sync" and log[11:] == ["elapsed"] * 3


def test_cuda_device_with_index_uses_events():
    cuda = FakeCuda()
    t = time_step(gpu_stepper(cuda, [1.0, 1.0]), device=torch.device("cuda", 0), steps=1, warmup=1, cuda=cuda)
    assert t.times == pytest.approx([0.001])


def test_oom_becomes_a_clear_error_and_cache_released():
    cuda = FakeCuda()

    def step():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(OutOfMemory, match="out of memory") as exc:
        time_step(step, device="cuda", steps=2, warmup=1, cuda=cuda)
    assert isinstance(exc.value, FlopcountError)
    assert "empty_cache" in cuda.log


def test_cpu_allocation_failure_is_oom():
    def step():
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1099511627776 bytes")

    with pytest.raises(OutOfMemory):
        time_step(step, device="cpu", steps=1, warmup=0)


def test_other_errors_pass_through():
    def step():
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError):
        time_step(step, device="cpu", steps=1, warmup=0)


def test_oom_in_a_real_allocation():
    with pytest.raises(OutOfMemory):
        with oom_as_error("a huge allocation"):
            torch.empty(2 ** 62, dtype=torch.uint8)


@pytest.mark.parametrize("steps,warmup", [(0, 1), (3, -1)])
def test_bad_counts(steps, warmup):
    with pytest.raises(TimingError):
        time_step(lambda: None, device="cpu", steps=steps, warmup=warmup)


def test_unknown_device_type():
    with pytest.raises(TimingError):
        time_step(lambda: None, device="meta", steps=1, warmup=0)


def test_train_step_updates_weights_and_clears_grads():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    before = model.weight.detach().clone()
    step = make_train_step(model, torch.randn(5, 4))
    step()
    assert not torch.equal(model.weight, before)  # optimizer step ran
    assert model.weight.grad is None  # zero_grad ran (set_to_none)


def test_train_step_with_target_and_loss():
    model = torch.nn.Linear(4, 1)
    seen = []

    def mse(out, target):
        seen.append(target.shape)
        return torch.nn.functional.mse_loss(out, target)

    step = make_train_step(model, torch.randn(5, 4), loss_fn=mse, target=torch.zeros(5, 1))
    step()
    assert seen == [torch.Size([5, 1])]


def test_time_epoch_counts_samples_and_excludes_warmup():
    clock = FakeClock()

    class Ticking(torch.nn.Linear):
        """Each forward costs one fake second, warm-up steps included: timing them would show."""

        def forward(self, x):
            clock.now += 1.0
            return super().forward(x)

    model = Ticking(4, 3)
    data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.zeros(10, dtype=torch.long))
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # 4 + 4 + 2
    seen = []

    def on_batch(inputs, target):
        seen.append(inputs.shape[0])

    seconds, samples = time_epoch(model, loader, device="cpu", warmup=2, clock=clock, on_batch=on_batch)
    assert samples == 10 and seen == [4, 4, 2]
    assert seconds == pytest.approx(3.0)  # 3 timed forwards; the 2 warm-up ones (2 s more) are not in it

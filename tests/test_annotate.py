"""flopcount.recording.nvtx.annotate against a recording stand-in for the nvtx API: which ranges a training loop gets, how
they nest, and that the loop computes exactly what it computes without them."""
import copy
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import flopcount.recording.nvtx as fnvtx
from flopcount.base.errors import FlopcountError, one_line
from flopcount.recording.nvtx import annotate, parse_text


class Recorder:
    """The nvtx Domain interface (get_event_attributes, push_range, pop_range), writing down every call."""

    def __init__(self):
        self.events = []

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        return message, color

    def push_range(self, attributes=None, **kwargs):
        self.events.append(("push", attributes[0], attributes[1], threading.get_ident()))

    def pop_range(self):
        self.events.append(("pop", None, None, threading.get_ident()))


class Node:
    def __init__(self, text, parent):
        self.text, self.parent, self.children = text, parent, []


def forest(events):
    """The ranges of each thread as trees; fails unless every pop closes a range pushed on its own thread."""
    roots, open_ = {}, {}
    for kind, text, _, tid in events:
        stack = open_.setdefault(tid, [])
        if kind == "push":
            node = Node(text, stack[-1] if stack else None)
            (stack[-1].children if stack else roots.setdefault(tid, [])).append(node)
            stack.append(node)
        else:
            assert stack, "a pop without a push on its thread"
            stack.pop()
    assert all(not s for s in open_.values()), "ranges left open"
    return roots


def walk(nodes):
    for n in nodes:
        yield n
        yield from walk(n.children)


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                        torch.nn.ReLU(inplace=True))
        self.block = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
                                         torch.nn.MaxPool2d(2))
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5))

    def forward(self, x):
        y = self.stem(x)
        return self.head(self.block(y) + F.max_pool2d(y, 2))  # a residual branch outside any module


def _loop(model, x, y, steps=2):
    """The user's loop, as it is; returns what it computed: outputs, losses, gradients, parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for _ in range(steps):
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        seen.append((out.detach().clone(), loss.detach().clone(),
                     [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return seen, [p.detach().clone() for p in model.parameters()]


def _setup():
    torch.manual_seed(0)
    model = SmallCNN()
    return model, torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])


def test_two_steps_of_a_small_cnn_mark_each_step_phase_and_module_once():
    model, x, y = _setup()
    plain_model = copy.deepcopy(model)
    rec = Recorder()
    with annotate(model, domain=rec):
        seen, params = _loop(model, x, y)
    plain_seen, plain_params = _loop(plain_model, x, y)

    # bit for bit the same outputs, losses, gradients and updated parameters
    for (out, loss, grads), (p_out, p_loss, p_grads) in zip(seen, plain_seen):
        assert torch.equal(out, p_out) and torch.equal(loss, p_loss)
        assert all(torch.equal(g, pg) for g, pg in zip(grads, p_grads))
    assert all(torch.equal(p, pp) for p, pp in zip(params, plain_params))

    trees = forest(rec.events)
    assert list(trees) == [threading.get_ident()]  # on the CPU the backward runs on the loop's thread
    steps = trees[threading.get_ident()]
    assert [s.text for s in steps] == ["step 0", "step 1"]
    paths = [name for name, _ in model.named_modules()]
    for s in steps:
        assert [p.text for p in s.children] == ["forward", "backward", "optimizer"]
        fwd, bwd, opt = s.children
        assert opt.children == []
        for phase, direction in ((fwd, "forward"), (bwd, "backward")):
            ranges = list(walk(phase.children))
            kinds = [parse_text(r.text) for r in ranges]
            # one range per module and direction, and nothing else in the phase
            assert sorted(name for _, name, _ in kinds) == sorted(paths)
            assert {(k, d) for k, _, d in kinds} == {("module", direction)}
            # nested as the modules are: each range's parent is its module's parent
            for r, (_, name, _) in zip(ranges, kinds):
                if name == "":
                    assert r.parent is phase and r.text == f"{direction}: [SmallCNN]"
                else:
                    parent = name.rpartition(".")[0]
                    assert parse_text(r.parent.text)[1] == parent, (r.text, r.parent.text)
    # colours per phase, module ranges in their phase's shade
    colors = {text: color for kind, text, color, _ in rec.events if kind == "push"}
    assert colors["forward"] == fnvtx.COLORS["forward"] != colors["backward"] == fnvtx.COLORS["backward"]
    assert colors["forward: stem.0"] == fnvtx.MODULE_COLORS["forward"]
    assert colors["backward: stem.0"] == fnvtx.MODULE_COLORS["backward"]


def test_the_loop_is_left_as_it_was():
    model, x, y = _setup()
    backward = torch.autograd.backward
    with annotate(model, domain=Recorder()):
        _loop(model, x, y, steps=1)
        assert torch.autograd.backward is not backward
    assert torch.autograd.backward is backward
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    assert not _global_optimizer_pre_hooks and not _global_optimizer_post_hooks


def test_in_place_relu_after_batch_norm_runs():
    """resnet18: full backward hooks would raise on its in-place ReLU; the graph hooks see every module."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = tv.models.resnet18(num_classes=10)
    rec = Recorder()
    with annotate(model, domain=rec):
        _loop(model, torch.randn(2, 3, 32, 32), torch.tensor([1, 2]), steps=1)
    (steps,) = forest(rec.events).values()
    fwd, bwd, _ = steps[0].children
    calls = [parse_text(r.text)[1] for r in walk(fwd.children)]
    back = [parse_text(r.text)[1] for r in walk(bwd.children)]
    assert sorted(calls) == sorted(back)  # relu modules run twice per block: twice both ways
    assert set(calls) == {name for name, _ in model.named_modules()}


def test_backward_on_another_thread_gets_its_module_ranges_there():
    """As on a GPU, where the engine's device thread runs the backward: module ranges on that thread, nested."""
    model, x, y = _setup()
    rec = Recorder()
    with annotate(model, domain=rec):
        loss = F.cross_entropy(model(x), y)
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join()
    trees = forest(rec.events)
    assert set(trees) == {threading.get_ident(), worker.ident}
    (root,) = trees[worker.ident]
    assert root.text == "backward: [SmallCNN]"
    assert sorted(parse_text(r.text)[1] for r in walk([root])) == sorted(n for n, _ in model.named_modules())


def test_decorated_step_function_is_one_step_per_call():
    model, x, y = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder()

    @annotate(model, domain=rec, first_step=5)
    def train_step(inputs, target):
        loss = F.cross_entropy(model(inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(3):
        train_step(x, y)
    steps = forest(rec.events)[threading.get_ident()]
    assert [s.text for s in steps] == ["step 5", "step 6", "step 7"]
    assert all([p.text for p in s.children] == ["forward", "backward", "optimizer"] for s in steps)
    assert all(not m._forward_pre_hooks for m in model.modules())  # installed for the call only


def test_loop_without_an_optimizer_and_an_evaluation_forward():
    """No optimizer: a forward after a backward begins the next step. A forward without grad is no step."""
    model, x, y = _setup()
    rec = Recorder()
    with annotate(model, domain=rec):
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        with torch.no_grad():
            model(x)
    top = forest(rec.events)[threading.get_ident()]
    assert [t.text for t in top] == ["step 0", "step 1", "forward: [SmallCNN]"]
    assert [p.text for p in top[0].children] == ["forward", "backward"]


def test_an_exception_inside_the_loop_leaves_no_range_open():
    model, x, y = _setup()
    rec = Recorder()
    with pytest.raises(RuntimeError, match="boom"):
        with annotate(model, domain=rec):
            F.cross_entropy(model(x), y).backward()
            raise RuntimeError("boom")
    forest(rec.events)  # balanced


def test_without_a_profiler_nothing_is_installed():
    pytest.importorskip("nvtx")
    model, x, y = _setup()
    ann = annotate(model)
    assert not ann.active  # no tool attached: the nvtx package's no-op domain
    backward = torch.autograd.backward
    with ann:
        assert torch.autograd.backward is backward
        assert all(not m._forward_pre_hooks for m in model.modules())
        _loop(model, x, y, steps=1)

    def step():
        return 1

    assert ann(step) is step


def test_missing_nvtx_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx now raises ImportError
    with pytest.raises(FlopcountError) as info:
        annotate(torch.nn.Linear(2, 2))
    line = one_line(info.value)
    assert 'pip install "flopcount[nvtx]"' in line and "\n" not in str(info.value)
    # a stand-in domain needs no package
    annotate(torch.nn.Linear(2, 2), domain=Recorder())


def test_range_texts_read_back():
    assert parse_text("step 12") == ("step", "12", "")
    assert parse_text("optimizer") == ("phase", "optimizer", "")
    assert parse_text("backward: layer1.0.conv1") == ("module", "layer1.0.conv1", "backward")
    assert parse_text("forward: [ResNet]") == ("module", "", "forward")
    assert parse_text("step x")[0] == parse_text("ncclSend")[0] == "other"

"""``flopcount infer`` through ``main()``: without a device, the counts and one line naming the options that add
rates; the dtype the model's config names (as it is served), said in the header, on a ``--device-spec`` too."""
import json
import shutil

import pytest

from flopcount.cli import main as cli

TINY = "tests/fixtures/hf/llama-gqa-tiny"
# llama-gqa-tiny: 2 layers, 2 key/value heads of 64 / 8 = 8 dimensions; a prefill of 8 tokens writes its keys and
# values once per layer
KV_ENTRIES = 2 * 2 * 8 * 2 * 8


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """llama-gqa-tiny with ``torch_dtype: bfloat16`` in its config, as a checkpoint's config says it."""
    folder = tmp_path_factory.mktemp("bf16") / "llama"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, torch_dtype="bfloat16")))
    return f"hf:{folder}"


def test_without_a_device_one_line_names_what_adds_rates(bf16, capsys):
    assert cli(["infer", bf16, "--prompt", "8", "--new", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "dtype=bfloat16 (config)" in out[0]
    hint = [line for line in out if "--device-spec" in line]
    assert len(hint) == 1 and "--device cpu" in hint[0] and "tokens/s" in hint[0]
    assert not any("roofline" in line for line in out)


def test_with_a_device_spec_the_config_dtype_is_taken_and_said(bf16, capsys):
    from flopcount.device.datasheet import get_device

    assert cli(["infer", bf16, "--prompt", "8", "--new", "2", "--device-spec", "H100 SXM", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["dtype"], doc["dtype_source"]) == ("bfloat16", "config")
    assert doc["phases"]["prefill"]["kv_written"] == KV_ENTRIES * 2  # two bytes an entry
    assert doc["roofline"]["phases"]["prefill"]["peak_flops"] == get_device("H100 SXM").peak("bf16")

    assert cli(["infer", bf16, "--prompt", "8", "--new", "2", "--device-spec", "H100 SXM"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "dtype=bfloat16 (config)" in out[0]
    assert not any("counts only" in line for line in out)

    # --dtype still wins, and a config that names no dtype keeps float32 (nothing said about a source)
    assert cli(["infer", bf16, "--prompt", "8", "--new", "2", "--device-spec", "H100 SXM", "--dtype", "float32",
                "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dtype"] == "float32" and "dtype_source" not in doc
    assert doc["phases"]["prefill"]["kv_written"] == KV_ENTRIES * 4

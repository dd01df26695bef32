"""``mhar-ablate export-hf``: a baseline run becomes a transformers Qwen3 folder with this decoder's logits (and
the import reads it back to the same tensors); a routed run becomes safetensors + config.yaml that
``load_decoder`` loads; what Qwen3 cannot express is refused; OUT is never overwritten or left half-written.
Also the metadata of ``weights.safetensors``, and files without it reading as before."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mhar_ablate.cli import main
from mhar_ablate.config import build_config
from mhar_ablate.model import Decoder
from mhar_ablate.model.weights import load_decoder, read_state_dict, read_weights_metadata, weights_metadata

from cli_helpers import one_error

# As tests/interop/test_convert.py: this decoder against transformers' Qwen3 in fp32 differs by ~2e-6 on logits of
# order 1 (the same operations in another order); a wiring mistake moves them by O(1).
HF_ATOL = 1e-5


def built_run(folder: Path, tied: bool = True, **overrides: str) -> tuple[Path, Decoder]:
    """A study-style run folder (config.yaml, result.json, weights.safetensors; no checkpoint) holding a random
    decoder whose every norm gain is randomised too (ones would hide a swapped norm)."""
    cfg = build_config(overrides={"residual.kind": "baseline", "model.seq_len": "32",
                                  "model.tie_embeddings": str(tied).lower(), **overrides})
    torch.manual_seed(1)
    model = Decoder(cfg.model, cfg.residual, 256).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.1)
    folder.mkdir(parents=True)
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    (folder / "config.yaml").write_text(text)
    (folder / "result.json").write_text(json.dumps({"status": "completed", "step": 7}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "weights.safetensors"),
              metadata=weights_metadata(text, 256, {"kind": "byte"}, 7))
    return folder, model


def tokens(n: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("tied", [True, False])
def test_baseline_exports_to_transformers_with_equal_logits_and_imports_back(tmp_path, capsys, tied):
    transformers = pytest.importorskip("transformers")
    from mhar_ablate.interop.convert import read_source

    run, ours = built_run(tmp_path / "run", tied)
    out = tmp_path / "hf"
    assert main(["export-hf", str(run), str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"exported: {out}" in printed and "from_pretrained" in printed
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert not list(tmp_path.glob(".hf.tmp-*"))

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.dtype == torch.float32
    idx = tokens()
    with torch.no_grad():
        theirs, mine = hf(idx).logits, ours(idx)
    assert (theirs - mine).abs().max().item() < HF_ATOL and mine.abs().max().item() > 0.1

    # The byte tokenizer as transformers reads it: the UTF-8 bytes, and back.
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "héllo wörld 🙂\n\tend"
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text

    # The other way: the import reads the folder back to the very tensors exported.
    src = read_source(out)
    assert src.model["tie_embeddings"] is tied
    state = ours.state_dict()
    assert set(src.state) == set(state) and all(torch.equal(src.state[k], state[k]) for k in state)
    meta = read_weights_metadata(out / "model.safetensors")
    assert meta["step"] == 7 and meta["config"]["residual"]["kind"] == "baseline"


def corpus(tmp_path: Path) -> Path:
    root = Path(__file__).resolve().parents[2] / "mhar_ablate"
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(p.read_text() for p in sorted(root.rglob("*.py"))))
    return path


def test_trained_bpe_run_exports_with_its_tokenizer_and_keeps_metadata(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from mhar_ablate.evaluation.trained import load_trained
    from mhar_ablate.training.checkpoint import save_final_weights
    from mhar_ablate.training.run import train_run

    out = tmp_path / "out"
    cfg = build_config(overrides={"data.source": str(corpus(tmp_path)), "data.tokenizer": "bpe", "data.vocab_size": "300",
                                  "model.seq_len": "32", "train.batch_size": "4", "train.eval_every": "1",
                                  "train.eval_batches": "1", "data.val_sequences": "4", "data.final_sequences": "0",
                                  "residual.kind": "baseline", "train.steps": "2", "train.threads": "2"})
    run = out / "runs" / "base"
    assert train_run(cfg, run, out / "cache", log=lambda s: None)["status"] == "completed"

    # Without transformers the export writes the same files: it needs only safetensors and JSON.
    monkeypatch.setitem(sys.modules, "transformers", None)
    capsys.readouterr()
    assert main(["export-hf", "base", str(tmp_path / "hf"), "--output", str(out)]) == 0
    monkeypatch.undo()
    assert "tokenizer: the BPE the run trained" in capsys.readouterr().out
    trained = load_trained(run, out / "cache")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def main(argv):\n    return sys.exit(0)  # héllo"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == trained.tokenizer.encode(text) and tok.eos_token_id == trained.tokenizer.eos_id
    with torch.no_grad():
        x = torch.tensor([ids[:24]])
        assert (hf(x).logits - trained.model(x)).abs().max().item() < HF_ATOL

    # weights.safetensors names its config, vocabulary, tokenizer, version and step.
    from mhar_ablate import __version__

    path = save_final_weights(run)
    meta = read_weights_metadata(path)
    assert meta["config"] == yaml.safe_load((run / "config.yaml").read_text())
    assert (meta["vocab_size"], meta["step"], meta["version"]) == (300, 2, __version__)
    assert meta["tokenizer"]["kind"] == "bpe" and meta["tokenizer"]["vocab_size"] == 300

    # A file without metadata (an older one) reads as before: read_state_dict, load_decoder, evaluation.
    state = read_state_dict(path)
    save_file(state, str(path))
    assert read_weights_metadata(path) == {}
    (run / "checkpoints" / "last.ckpt").unlink()
    idx = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_decoder(run)(idx), trained.model(idx))
        assert torch.equal(load_trained(run, out / "cache").model(idx), trained.model(idx))


def test_routed_run_is_safetensors_and_config_that_load_decoder_loads(tmp_path, capsys):
    run, ours = built_run(tmp_path / "studies" / "s" / "steps" / "mhar-h2-s0", **{"residual.kind": "mhar",
                                                                                   "residual.heads": "2"})
    out = tmp_path / "exported"
    out.mkdir()  # an empty folder may be the target
    capsys.readouterr()
    assert main(["export-hf", str(run), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "transformers has no residual.kind=mhar architecture" in printed
    snippet = next(line for line in printed.splitlines() if "load_decoder" in line)
    assert "from mhar_ablate.model.weights import load_decoder" in snippet
    assert {p.name for p in out.iterdir()} == {"weights.safetensors", "config.yaml", "tokenizer.json",
                                                "tokenizer_config.json"}
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(load_decoder(out)(idx), ours(idx))
        assert torch.equal(load_decoder(out / "weights.safetensors")(idx), ours(idx))  # from metadata alone


def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys, monkeypatch):
    run, ours = built_run(tmp_path / "run")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    assert "not empty" in one_error(capsys, ["export-hf", str(run), str(tmp_path / "full")])
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    assert "no run" in one_error(capsys, ["export-hf", str(tmp_path / "nothing"), str(tmp_path / "o")])

    # A tensor Qwen3 has no place for (a bias) is refused, not dropped.
    biased, _ = built_run(tmp_path / "biased")
    state = read_state_dict(biased / "weights.safetensors")
    save_file({**state, "sublayers.0.q_proj.bias": torch.zeros(64)}, str(biased / "weights.safetensors"))
    assert "no place in Qwen3" in one_error(capsys, ["export-hf", str(biased), str(tmp_path / "o")])

    # Weights whose output matrix contradicts model.tie_embeddings.
    untied, _ = built_run(tmp_path / "untied", tied=False)
    data = yaml.safe_load((untied / "config.yaml").read_text())
    data["model"]["tie_embeddings"] = True
    (untied / "config.yaml").write_text(yaml.safe_dump(data))
    assert "tie_embeddings" in one_error(capsys, ["export-hf", str(untied), str(tmp_path / "o")])

    # A model setting whose Qwen3 form the exporter does not know (a key added to the decoder later).
    import mhar_ablate.interop.export_hf as ex

    monkeypatch.setattr(ex, "EXPRESSED", {k: v for k, v in ex.EXPRESSED.items() if k != "rope_theta"})
    assert "model.rope_theta" in one_error(capsys, ["export-hf", str(run), str(tmp_path / "o")])
    monkeypatch.undo()

    # A failure while writing leaves neither OUT nor the temporary folder.
    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", boom)
    capsys.readouterr()
    assert main(["export-hf", str(run), str(tmp_path / "o")]) != 0
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*"))

"""``mhar-ablate convert``: a trained pre-norm model (a package run, or a Hugging Face Qwen3 folder) becomes
MHAR's delta form computing exactly what it computed, and this decoder is the Qwen3 it claims to be."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from mhar_ablate.cli import main
from mhar_ablate.config import build_config
from mhar_ablate.interop.convert import build_converted, converted_config, read_source
from mhar_ablate.model import Decoder
from mhar_ablate.model.weights import load_initial
from mhar_ablate.training.run import load_run_config, train_run

from cli_helpers import one_error

transformers = pytest.importorskip("transformers")

# Our decoder against transformers' Qwen3 in fp32: the same operations in a different order (RoPE angles
# from an outer product rather than a matmul, SDPA against eager attention); measured max |diff|: 2.2e-6
# (tied) and 2.6e-6 (untied) on logits up to 3.7 (transformers 5.24), so 1e-5 is fp32 precision with
# headroom, and far below any wiring mistake (a swapped norm or the wrong output matrix moves them by O(1)).
HF_ATOL = 1e-5


def tiny_qwen3(folder: Path, tied: bool, vocab: int = 300) -> torch.nn.Module:
    """A random Qwen3 with every norm gain randomised too (ones would hide a swapped norm)."""
    torch.manual_seed(1)
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, rope_theta=10_000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=tied, attn_implementation="eager")
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def random_tokens(vocab: int, n: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(3))


def baseline_from(src, seq_len: int) -> Decoder:
    cfg = build_config(overrides={"residual.kind": "baseline", "model.seq_len": seq_len,
                                  **{f"model.{k}": v for k, v in src.model.items() if k not in ("preset", "seq_len")}})
    model = Decoder(cfg.model, cfg.residual, cfg.model.vocab_size)
    load_initial(model, src.state, "test")
    return model.eval()


@pytest.mark.parametrize("tied", [True, False])
def test_hf_qwen3_matches_transformers_and_converts_exactly(tmp_path, tied):
    hf = tiny_qwen3(tmp_path / "qwen3", tied)
    src = read_source(tmp_path / "qwen3")
    assert src.model["tie_embeddings"] is tied and ("lm_head.weight" in src.state) is not tied
    ours = baseline_from(src, 64)
    idx = random_tokens(300)
    with torch.no_grad():
        theirs = hf(idx).logits
        plain = ours(idx)
    assert (plain - theirs).abs().max().item() < HF_ATOL
    # A wrong mapping (tied head on an untied model, swapped norms) would differ by O(1).
    assert theirs.abs().max().item() > 0.1
    cfg = converted_config(src, heads=4, blocks=2, config_file=None, overrides={"model.seq_len": "64"})
    converted, diff = build_converted(cfg, src.state, "test")
    with torch.no_grad():
        assert torch.equal(converted(idx), plain)  # exactly, in fp32
    assert diff == 0.0 and cfg.residual.kind == "delta" and cfg.residual.grouping == "block:2"


def corpus(tmp_path: Path) -> Path:
    root = Path(__file__).resolve().parents[2] / "mhar_ablate"
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(p.read_text() for p in sorted(root.rglob("*.py"))))
    return path


def test_package_run_converts_exactly_and_trains_on(tmp_path, capsys):
    out = tmp_path / "out"
    cfg = build_config(overrides={"data.source": str(corpus(tmp_path)), "model.seq_len": "32", "train.batch_size": "4",
                                  "train.eval_every": "2", "train.eval_batches": "2", "data.val_sequences": "8",
                                  "residual.kind": "baseline", "train.steps": "4", "train.threads": "2"})
    source = train_run(cfg, out / "runs" / "base", out / "cache", log=lambda s: None)
    assert source["status"] == "completed"
    capsys.readouterr()
    assert main(["convert", str(out / "runs" / "base"), "--heads", "4", "--blocks", "2", "--output", str(out),
                 "--steps", "2", "residual.backend=reference"]) == 0
    printed = capsys.readouterr().out
    run_dir = Path(next(line.split()[2] for line in printed.splitlines() if line.startswith("run folder:")))
    conv = load_run_config(run_dir)
    assert (conv.residual.kind, conv.residual.heads, conv.residual.grouping) == ("delta", 4, "block:2")
    assert conv.train.first_batch == 4 and conv.train.steps == 2  # reads on in the source's data stream
    assert Path(conv.train.init) == (run_dir / "init.safetensors").resolve()

    # The converted weights against the source checkpoint's, as pre-norm: equal logits, exactly.
    src = read_source(out / "runs" / "base" / "checkpoints" / "last.ckpt")
    original = baseline_from(src, 32)
    converted, diff = build_converted(conv, src.state, "test")
    idx = random_tokens(256, 32)
    with torch.no_grad():
        assert torch.equal(converted(idx), original(idx)) and diff == 0.0

    # `train --resume` trains it; its step-0 evaluation is the source's last one (same weights, same batches).
    assert main(["train", "--output", str(out), "--resume", run_dir.name]) == 0
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["step"] == 2
    assert result["curve"][0]["step"] == 0
    assert result["curve"][0]["val_loss"] == source["final_val_loss"]


def test_tokenizer_json_of_the_folder_is_used(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tiny_qwen3(tmp_path / "qwen3", tied=True)
    vocab = {chr(ord("a") + i): i for i in range(26)} | {"<|endoftext|>": 26}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "qwen3" / "tokenizer.json"))
    src = read_source(tmp_path / "qwen3")
    cfg = converted_config(src, 1, 4, None, {})
    assert cfg.data.tokenizer == str((tmp_path / "qwen3" / "tokenizer.json").resolve())
    assert cfg.model.seq_len == 64  # max_position_embeddings, under the cap


def test_bad_sources_are_one_line_and_exit_2(tmp_path, capsys):
    tiny_qwen3(tmp_path / "qwen3", tied=True)
    conv = ["--heads", "4", "--blocks", "2", "--output", str(tmp_path / "out")]

    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "not 'qwen3'" in one_error(capsys, ["convert", str(llama), *conv])

    # Shapes that do not fit: config.json claims a wider model than the weights hold.
    wide = tmp_path / "wide"
    wide.mkdir()
    hf = json.loads((tmp_path / "qwen3" / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**hf, "hidden_size": 128}))
    (wide / "model.safetensors").write_bytes((tmp_path / "qwen3" / "model.safetensors").read_bytes())
    assert "shape" in one_error(capsys, ["convert", str(wide), *conv])

    # A tensor this decoder has no place for (a bias) is refused, not dropped.
    from safetensors.torch import load_file, save_file

    biased = tmp_path / "biased"
    biased.mkdir()
    (biased / "config.json").write_text(json.dumps(hf))
    state = load_file(str(tmp_path / "qwen3" / "model.safetensors"))
    save_file({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, str(biased / "model.safetensors"))
    assert "unexpected tensor" in one_error(capsys, ["convert", str(biased), *conv])

    # Pickled weights only: not read.
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(hf))
    torch.save(state, pickled / "pytorch_model.bin")
    assert "safetensors" in one_error(capsys, ["convert", str(pickled), *conv])

    assert "must divide" in one_error(capsys, ["convert", str(tmp_path / "qwen3"), "--heads", "4", "--blocks", "3"])
    assert "does not divide" in one_error(capsys, ["convert", str(tmp_path / "qwen3"), "--heads", "3", "--blocks", "2"])
    assert "come from the source" in one_error(capsys, ["convert", str(tmp_path / "qwen3"), *conv, "model.d_model=32"])
    assert "neither" in one_error(capsys, ["convert", str(tmp_path / "nothing"), *conv])
    # The configured byte tokenizer (256 ids) does not fit a 200-token model.
    small = tmp_path / "small"
    tiny_qwen3(small, tied=True, vocab=200)
    assert "more than the source's" in one_error(capsys, ["convert", str(small), *conv])


def test_routed_run_and_unsafe_checkpoint_are_refused(tmp_path, capsys):
    cfg = build_config(overrides={"residual.kind": "mhar", "residual.heads": "2"})
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    assert "residual.kind=mhar" in one_error(capsys, ["convert", str(run), "--heads", "2", "--blocks", "2"])

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled')",))

    cfg = build_config(overrides={"residual.kind": "baseline"})
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    torch.save({"state_dict": {}, "x": Boom()}, run / "checkpoints" / "last.ckpt")
    assert "cannot be loaded safely" in one_error(capsys, ["convert", str(run), "--heads", "2", "--blocks", "2"])

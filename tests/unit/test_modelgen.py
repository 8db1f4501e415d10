import hashlib
import subprocess
import sys

import pytest


def test_builtin_models_import_does_not_pull_in_torch():
    # Config validation imports BUILTIN_MODELS; it must stay light. Fresh
    # interpreter, because this test process may already have torch loaded.
    code = ("import sys; from pdserve.engine.models import BUILTIN_MODELS; "
            "assert {'tiny', 'mid'} <= set(BUILTIN_MODELS); "
            "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


@pytest.mark.slow  # builds the tiny model twice: a few seconds
def test_ensure_model_tiny_is_deterministic(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from pdserve.engine.models import MARKER, ensure_model

    def digests(path):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}

    a = ensure_model("tiny", tmp_path / "a")
    b = ensure_model("tiny", tmp_path / "b")
    assert a == tmp_path / "a" / "tiny" and (a / MARKER).is_file()
    assert (a / "model.safetensors").is_file()
    assert digests(a) == digests(b)
    assert ensure_model("tiny", tmp_path / "a") == a  # second call reuses, no rebuild
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["tiny"]  # no temp dirs left


@pytest.mark.slow  # builds the mid model: ~10 s
def test_every_id_a_builtin_model_can_generate_is_a_token(tmp_path):
    """The model's vocabulary is the tokenizer's: an id beyond it decodes to nothing (empty replies)."""
    pytest.importorskip("transformers")
    import json

    from transformers import AutoTokenizer

    from pdserve.engine.models import ensure_model

    path = ensure_model("mid", tmp_path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert vocab == len(tokenizer)
    assert all(tokenizer.decode([i]) for i in range(3, vocab))

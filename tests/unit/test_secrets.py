from lmforge.runtime.secrets import REDACTED, is_secret_name, redact, redact_text


def test_secret_names():
    for name in ("WANDB_API_KEY", "HF_TOKEN", "apikey", "AWS_SECRET_ACCESS_KEY", "db.password"):
        assert is_secret_name(name), name
    for name in ("tokenizer", "planned_tokens", "tokens_per_s", "keep_last", "WANDB_MODE"):
        assert not is_secret_name(name), name


def test_redact_keys_and_values():
    env = {"WANDB_API_KEY": "sekrit-123456"}
    obj = {"logging": {"api_key": "x1234567"}, "argv": ["--note=sekrit-123456"], "data": {"tokenizer": "embedded"}}
    out = redact(obj, env)
    assert out["logging"]["api_key"] == REDACTED
    assert out["argv"] == [f"--note={REDACTED}"]
    assert out["data"]["tokenizer"] == "embedded"
    assert redact_text("key=sekrit-123456!", env) == f"key={REDACTED}!"

"""API keys and tenants: the keys file, authentication, model allow-lists, reload, `keys add`."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from tokenline.cli import main
from tokenline.gateway.keys import KeyFileError, KeyStore, Tenant, TenantLimits, add_key, hash_key

ACME_KEY = "tl-acme-secret"
BETA_KEY = "tl-beta-secret"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write_keys(path: Path) -> Path:
    path.write_text(f"""
[[tenant]]
name = "acme"
key_sha256 = "{sha(ACME_KEY)}"
models = ["*"]
requests_per_minute = 60
tokens_per_minute = 20000
max_concurrent = 4
daily_tokens = 1000000
admin = true

[[tenant]]
name = "beta"
key_sha256 = "{sha(BETA_KEY).upper()}"
models = ["smollm2", "qwen3"]
""")
    return path


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    return write_keys(tmp_path / "keys.toml")


def test_parses_tenants_and_limits(keys_file: Path) -> None:
    store = KeyStore.from_file(keys_file)
    acme, beta = store.tenants
    assert acme == Tenant("acme", sha(ACME_KEY), ("*",), TenantLimits(60, 20000, 4, 1000000), admin=True)
    # Absent limits are unlimited; the hash is normalized to lower case; admin defaults to false.
    assert beta.limits == TenantLimits() and beta.limits.unlimited
    assert beta.key_sha256 == sha(BETA_KEY)
    assert beta.models == ("smollm2", "qwen3") and not beta.admin
    assert "key_sha256" not in repr(acme)


def test_authenticate(keys_file: Path) -> None:
    store = KeyStore.from_file(keys_file)
    assert store.authenticate(ACME_KEY).name == "acme"
    assert store.authenticate(BETA_KEY).name == "beta"
    assert store.authenticate("tl-wrong") is None
    assert store.authenticate(ACME_KEY + " ") is None
    assert store.authenticate(sha(ACME_KEY)) is None  # the stored hash is not a key
    assert store.authenticate("") is None
    assert store.authenticate(None) is None


def test_single_key_mode() -> None:
    single = KeyStore.single_key("secret")
    tenant = single.authenticate("secret")
    assert tenant is not None and tenant.name == "default" and tenant.admin and tenant.limits.unlimited
    assert single.allows_model(tenant, "anything")
    assert single.authenticate("other") is None
    assert single.reload() == single.tenants  # nothing to re-read
    with pytest.raises(ValueError):
        KeyStore.single_key("")


def test_model_allow_list(keys_file: Path) -> None:
    store = KeyStore.from_file(keys_file)
    acme, beta = store.tenants
    assert store.allows_model(acme, "whatever")
    assert store.allows_model(beta, "smollm2") and store.allows_model(beta, "qwen3")
    assert not store.allows_model(beta, "llama")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[[tenant]]\nname = 'a'\n", "key_sha256"),
        (f"[[tenant]]\nname = 'a b'\nkey_sha256 = '{sha('x')}'\n", "name must be"),
        ("[[tenant]]\nname = 'a'\nkey_sha256 = 'tl-plain-key'\n", "64 hex digits"),
        (f"[[tenant]]\nname = 'a'\nkey_sha256 = '{sha('x')}'\nrequest_per_minute = 5\n", "unknown field"),
        (f"[[tenant]]\nname = 'a'\nkey_sha256 = '{sha('x')}'\nmax_concurrent = 0\n", "positive integer"),
        (f"[[tenant]]\nname = 'a'\nkey_sha256 = '{sha('x')}'\nmax_concurrent = true\n", "positive integer"),
        (f"[[tenant]]\nname = 'a'\nkey_sha256 = '{sha('x')}'\nmodels = []\n", "models"),
        (f"[[tenant]]\nname = 'a'\nkey_sha256 = '{sha('x')}'\nadmin = 'yes'\n", "admin"),
        (f"[[tenant]]\nname = 'a'\nkey_sha256 = '{sha('x')}'\n[[tenant]]\nname = 'a'\nkey_sha256 = '{sha('y')}'\n",
         "appears twice"),
        (f"[[tenant]]\nname = 'a'\nkey_sha256 = '{sha('x')}'\n[[tenant]]\nname = 'b'\nkey_sha256 = '{sha('x')}'\n",
         "same key_sha256"),
        ("[[tenant]\nname = ", "not valid TOML"),
        ("tenants = 1\n", "unknown top-level"),
    ],
)
def test_bad_files_are_refused_with_a_clear_message(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(body)
    with pytest.raises(KeyFileError, match=message):
        KeyStore.from_file(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot read"):
        KeyStore.from_file(tmp_path / "nope.toml")


def test_reload_picks_up_a_new_tenant_and_survives_a_broken_file(
    keys_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = KeyStore.from_file(keys_file)
    assert store.authenticate("tl-gamma") is None
    with keys_file.open("a") as f:
        f.write(f'\n[[tenant]]\nname = "gamma"\nkey_sha256 = "{sha("tl-gamma")}"\n')
    assert [t.name for t in store.reload()] == ["acme", "beta", "gamma"]
    assert store.authenticate("tl-gamma").name == "gamma"

    keys_file.write_text("[[tenant]]\nname = 'broken'\n")  # no key_sha256
    with caplog.at_level(logging.ERROR, logger="tokenline.gateway.keys"), pytest.raises(KeyFileError):
        store.reload()
    assert "not reloaded" in caplog.text and "keeping 3 tenant(s)" in caplog.text
    # The old tenants still work.
    assert store.authenticate(ACME_KEY).name == "acme"
    assert store.authenticate("tl-gamma").name == "gamma"


def test_add_key_stores_only_the_hash(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "keys.toml"  # created, with its folder
    key = add_key(path, "acme", requests_per_minute=10, tokens_per_minute=1000, max_concurrent=2,
                  daily_tokens=50000, models=["smollm2"], admin=True)
    assert key.startswith("tl-") and len(key) > 40
    text = path.read_text()
    assert key not in text and key[3:] not in text
    assert hash_key(key) in text
    other = add_key(path, "beta")
    assert other != key
    store = KeyStore.from_file(path)
    acme = store.authenticate(key)
    assert acme == Tenant("acme", hash_key(key), ("smollm2",), TenantLimits(10, 1000, 2, 50000), True)
    beta = store.authenticate(other)
    assert beta is not None and beta.name == "beta" and beta.limits.unlimited and beta.models == ("*",)
    assert not beta.admin


def test_add_key_refuses_duplicates_and_bad_values(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    add_key(path, "acme")
    before = path.read_text()
    with pytest.raises(KeyFileError, match="already exists"):
        add_key(path, "acme")
    with pytest.raises(KeyFileError, match="name must be"):
        add_key(path, "bad name")
    with pytest.raises(KeyFileError, match="positive integer"):
        add_key(path, "zero", requests_per_minute=0)
    assert path.read_text() == before  # nothing half-written
    # Keeps what was in the file, comments included.
    path.write_text("# our tenants\n" + before)
    add_key(path, "beta")
    assert path.read_text().startswith("# our tenants\n")
    assert [t.name for t in KeyStore.from_file(path).tenants] == ["acme", "beta"]


def test_cli_keys_add(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.toml"
    rc = main(["keys", "add", "acme", "--file", str(path), "--rpm", "60", "--tpm", "20000",
               "--max-concurrent", "4", "--daily-tokens", "1000000", "--models", "smollm2, qwen3", "--admin"])
    assert rc == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert key.startswith("tl-") and "\n" not in key  # stdout is the key alone, for scripts
    assert "cannot be shown again" in err
    assert key not in path.read_text()
    tenant = KeyStore.from_file(path).authenticate(key)
    assert tenant == Tenant("acme", hash_key(key), ("smollm2", "qwen3"), TenantLimits(60, 20000, 4, 1000000), True)

    assert main(["keys", "add", "acme", "--file", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "already exists" in err

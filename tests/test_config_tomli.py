"""TOML configuration files where the standard library has no ``tomllib`` (Python 3.10, which
``requires-python`` allows): the ``tomli`` package, a dependency there, reads them."""
import sys

from hicache_mc.config import MasterConfig, load_config


def test_toml_config_without_tomllib(tmp_path, monkeypatch):
    if sys.version_info >= (3, 11):
        import tomllib
        monkeypatch.setitem(sys.modules, "tomllib", None)   # `import tomllib` fails, as on 3.10
        monkeypatch.setitem(sys.modules, "tomli", tomllib)  # tomllib is tomli, adopted: same API
    f = tmp_path / "c.toml"
    f.write_text("[master]\nport = 7400\n")
    assert load_config(MasterConfig, str(f), env={}, section="master").port == 7400

"""``require_or_skip`` (tests/conftest.py): a missing Redis / Chromium / SmolLM2 skips a test, unless
``SWARMSERVE_REQUIRE`` names it, then the test fails and says what to install."""

from __future__ import annotations

import pytest

from tests.conftest import REQUIREMENTS, require_or_skip, required


def test_skips_when_not_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMSERVE_REQUIRE", "chromium, smollm")
    with pytest.raises(pytest.skip.Exception, match="no redis here"):
        require_or_skip("redis", "no redis here")
    monkeypatch.delenv("SWARMSERVE_REQUIRE")
    with pytest.raises(pytest.skip.Exception, match="no browser"):
        require_or_skip("chromium", "no browser")


@pytest.mark.parametrize("name", sorted(REQUIREMENTS))
def test_fails_naming_what_to_install_when_required(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv("SWARMSERVE_REQUIRE", f" {name.upper()} ,")  # case and spaces do not matter
    with pytest.raises(pytest.fail.Exception) as failed:
        require_or_skip(name, f"{name} is missing")
    message = str(failed.value)
    assert f"{name} is missing" in message and "SWARMSERVE_REQUIRE" in message
    assert REQUIREMENTS[name] in message  # what to install


def test_every_name_the_ci_requires_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMSERVE_REQUIRE", "redis,chromium,smollm")
    assert required() == {"redis", "chromium", "smollm"}
    monkeypatch.setenv("SWARMSERVE_REQUIRE", "")
    assert required() == set()


def test_a_typo_is_an_error_not_a_silent_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMSERVE_REQUIRE", "redis,chromuim")
    with pytest.raises(pytest.UsageError, match="chromuim"):
        require_or_skip("redis", "no redis")
    with pytest.raises(ValueError, match="unknown requirement"):
        require_or_skip("postgres", "no postgres")

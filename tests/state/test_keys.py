from __future__ import annotations

import pytest

from nori.state.keys import Keys


def test_every_key_is_namespaced() -> None:
    keys = Keys("prod")
    assert keys.worker("w1") == "prod:worker:w1"
    assert keys.request("r1") == "prod:request:r1"
    assert keys.block(bytes.fromhex("00ff10")) == "prod:block:00ff10"
    assert keys.worker_pattern() == "prod:worker:*"
    assert keys.pattern() == "prod:*"
    assert keys.worker_id_of(keys.worker("a:b")) == "a:b"
    assert Keys().worker("w") == "nori:worker:w"


@pytest.mark.parametrize("namespace", ["", "a:b", "a*", "a?", "[a]", "a b"])
def test_namespaces_that_could_match_other_keys_are_refused(namespace: str) -> None:
    with pytest.raises(ValueError):
        Keys(namespace)


def test_worker_id_of_refuses_foreign_keys() -> None:
    with pytest.raises(ValueError):
        Keys("a").worker_id_of("b:worker:w")

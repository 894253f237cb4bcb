"""Page keys: chained over every token before a page, salted, equal however the prompt is cut."""

import pytest

from worker.prefix_hash import page_keys


def test_keys_are_chained_and_only_full_pages_get_one():
    tokens = list(range(100, 150))  # 3 full pages of 16 and a partial one
    keys = page_keys(tokens, 16)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert page_keys(tokens[:32], 16) == keys[:2]
    assert page_keys(tokens[32:], 16, parent=keys[1]) == keys[2:]
    assert page_keys(tokens, 16, limit=1) == keys[:1]
    changed = [7] + tokens[1:]  # a first token changes every later page's key
    assert not set(page_keys(changed, 16)) & set(keys)
    # the same page content after a different prefix is a different page
    assert page_keys(tokens[16:32], 16)[0] != keys[1]


def test_salt_separates_and_bad_page_size_is_named():
    tokens = list(range(32))
    assert page_keys(tokens, 16, salt=b"tenant-a") != page_keys(tokens, 16)
    with pytest.raises(ValueError, match="page_size"):
        page_keys(tokens, 0)

"""README.md and the docs: every relative link (file and `#anchor`) of README.md and of
docs/*.md resolves, and README's two first examples (a Keras 3 block with
`@recompute_grad`, `AccumOptimizer`) run as written and train exactly alike with
RECOMPUTE off and on. (README's third example, `recompute.plan`, is an excerpt of
docs/plan.md's, which tests/recompute_keras3/test_plan.py runs.)"""

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text):
    """The text without its fenced code blocks (a link in code is not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(page):
    """The `#anchors` GitHub gives the headings of `page`."""
    seen, anchors = {}, set()
    for heading in re.findall(r"^#{1,6} +(.*?) *#*$", _prose(page.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _broken_links(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.is_file() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    return broken


def test_link_check_finds_a_broken_file_and_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## `A` heading: (with) punctuation\n")
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[a](other.md) [b](other.md#a-heading-with-punctuation) [c](#title)\n"
                    "[d](missing.md) [e](other.md#nope) [f](#nope) [g](https://example.com)\n"
                    "```\n[h](in-code.md)\n```\n")
    assert _broken_links(page) == ["missing.md", "other.md#nope", "#nope"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    assert _broken_links(page) == []


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"\]\(([\w.]+\.md)\)", index))
    assert listed == {p.name for p in PAGES[1:] if p.name != "index.md"}
    assert "](docs/index.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def _readme_python():
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)


@pytest.mark.fast
def test_readme_examples_run_and_train_alike_with_recompute_off_and_on():
    import keras

    import recompute

    block_code, accum_code = _readme_python()[:2]
    assert "@recompute_grad" in block_code and "AccumOptimizer(" in accum_code
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 16)).astype("float32")
    y = rng.normal(size=(32, 8, 16)).astype("float32")

    def train(on):
        keras.utils.set_random_seed(0)
        namespace = {}
        exec(block_code, namespace)  # defines Block
        model = keras.Sequential([keras.Input((8, 16)), namespace["Block"](16, 2, 32)])
        namespace.update(model=model, x=x, y=y)
        before = [w.numpy() for w in model.weights]
        with recompute.recompute_scope(on):
            exec(accum_code.replace("loss=...", 'loss="mse"'), namespace)  # 8 micro-batches of 4
        assert int(model.optimizer.iterations) == 1  # one update, of batch 32
        after = [w.numpy() for w in model.weights]
        assert all(not np.array_equal(a, b) for a, b in zip(after, before))
        return after

    for off, on in zip(train(False), train(True)):
        np.testing.assert_allclose(on, off, rtol=1e-5, atol=1e-6)

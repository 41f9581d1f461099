"""The user docs stay true: README's Documentation section names every page in docs/ for its
reader, every page a doc names exists, docs/cli.md names every flag and help panel the commands
have (and no flag they lack), catalog.md's built-in layout is the built-in model's and its
example catalog serves on it, http-api.md's `completion_tokens` is what a server replies, and
benchmarks.md / reliability.md hold figures, not the story of how they were reached."""

from __future__ import annotations

import json
import re

import pytest
import typer

from grctl.catalog.loader import parse_catalog
from grctl.cli.root import app
from grctl.model.builtin import DEFAULT_CONFIG, NUM_TEXT_TOKENS, SID_CODES, SID_LEVELS
from tests.support import catalogs
from tests.support.cli import grctl
from tests.support.serverproc import REPO_ROOT

DOCS = REPO_ROOT / "docs"
README = REPO_ROOT / "README.md"
READERS = ("RL engineer", "Operator", "Everyone")


def section(text: str, heading: str) -> str:
    """The body of the markdown section `heading` (a whole heading line), up to the next
    heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n") + len(heading) + 1
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", text[start:], re.M)]
    return text[start : start + ends[0]] if ends else text[start:]


def test_readme_names_every_docs_page_under_its_reader():
    pages = {p.name for p in DOCS.glob("*.md")}
    body = section(README.read_text(), "## Documentation")
    bullets = re.findall(r"^- \*\*(.+?)\*\*(.*?)(?=^- |\Z)", body, re.M | re.S)
    assert bullets, body
    named: dict[str, str] = {}
    for reader, text in bullets:
        assert any(reader.startswith(r) for r in READERS), reader
        for page in re.findall(r"docs/([\w.-]+\.md)", text):
            assert page not in named, f"{page} listed for {named[page]} and {reader}"
            named[page] = reader
    assert set(named) == pages, (sorted(pages - set(named)), sorted(set(named) - pages))
    assert {r.split()[0] for r in named.values()} >= {"RL", "Operator"}


def test_every_page_a_doc_names_exists():
    for doc in [README, *DOCS.glob("*.md")]:
        text = doc.read_text()
        named = re.findall(r"docs/([\w-]+\.md)", text) + re.findall(r"\]\(([\w-]+\.md)", text)
        for page in named:
            assert (DOCS / page).is_file(), f"{doc.name} names docs/{page}"


def commands(group, path=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def long_flags(cmd, *, hidden: bool, negations: bool = True) -> list[str]:
    """The long names of `cmd`'s options (hidden: its other names), with or without the
    `--no-...` side of a boolean pair."""
    return [
        o
        for p in cmd.params
        if p.hidden == hidden
        for o in p.opts + (p.secondary_opts if negations else [])
        if o.startswith("--") and o != "--help"
    ]


def test_cli_md_names_every_flag_the_commands_have_and_none_they_lack():
    doc = (DOCS / "cli.md").read_text()
    root = typer.main.get_command(app)
    known = {o for p in root.params for o in p.opts + p.secondary_opts}
    for path, cmd in commands(root):
        known |= set(long_flags(cmd, hidden=False)) | set(long_flags(cmd, hidden=True))
        # serve's flags are listed by `grctl serve --help`; its other names (aliases) only here
        hidden = path == ("serve",)
        names = long_flags(cmd, hidden=hidden, negations=hidden)
        missing = [o for o in names if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", doc)]
        assert not missing, f"grctl {' '.join(path)}: {missing} not in docs/cli.md"
    # named in cli.md as what is *not* a flag of grctl, or another tool's
    others = {"--help", "--mem-fraction-static", "--tokenizer-path", "--shm-size"}
    stale = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", doc)) - known - others
    assert not stale, f"docs/cli.md names flags no command has: {sorted(stale)}"


def test_cli_md_lists_serves_help_panels_in_order():
    serve = typer.main.get_command(app).commands["serve"]
    panels = list(dict.fromkeys(p.rich_help_panel for p in serve.params if not p.hidden))
    panels = [p for p in panels if p]
    listed = re.search(
        r"`grctl serve --help` lists every flag by topic \(([^)]*)\)", (DOCS / "cli.md").read_text()
    )
    assert listed, "docs/cli.md does not list serve's help panels"
    assert re.split(r",\s*", listed.group(1).replace("\n", " ")) == panels


BUILTIN = "### A catalog for the built-in model"


def test_catalog_md_layout_is_the_built_in_models():
    body = section((DOCS / "catalog.md").read_text(), BUILTIN)
    assert f"{DEFAULT_CONFIG.vocab_size:,} tokens" in body
    assert f"ids 0-{NUM_TEXT_TOKENS - 1} are text" in body
    rows = re.findall(r"^\| (\w+) \| (\d+)-(\d+) \| `(\d+) \+ c` \|$", body, re.M)
    assert len(rows) == SID_LEVELS
    for level, (_, lo, hi, base) in enumerate(rows):
        first = NUM_TEXT_TOKENS + level * SID_CODES
        assert (int(lo), int(hi), int(base)) == (first, first + SID_CODES - 1, first)
    assert int(rows[-1][2]) == DEFAULT_CONFIG.vocab_size - 1
    assert catalogs.SID == NUM_TEXT_TOKENS  # the tests' own catalogs follow the same layout


def documented_catalog() -> tuple[bytes, dict]:
    body = section((DOCS / "catalog.md").read_text(), BUILTIN)
    jsonl = re.search(r"```json\n(.*?)```", body, re.S).group(1).encode()
    (curl,) = re.findall(r"curl -s localhost:8000/generate -d '(.*?)'", body)
    return jsonl, json.loads(curl)


def test_catalog_md_example_is_a_valid_catalog_of_the_built_in_model():
    jsonl, _ = documented_catalog()
    parse_catalog(jsonl, vocab_size=DEFAULT_CONFIG.vocab_size)  # raises on a bad file
    for line in jsonl.decode().splitlines():
        ids = json.loads(line)["token_ids"]
        assert len(ids) == SID_LEVELS
        for level, tok in enumerate(ids):
            assert 0 <= tok - NUM_TEXT_TOKENS - level * SID_CODES < SID_CODES, (line, level)


@pytest.fixture(scope="module")
def catalog_server(start_server, tmp_path_factory):
    jsonl, _ = documented_catalog()
    path = tmp_path_factory.mktemp("doc-catalog") / "catalog.jsonl"
    path.write_bytes(jsonl)
    return start_server("--catalog", str(path))


def test_catalog_md_commands_serve_its_items_and_count_tokens_as_http_api_says(catalog_server):
    jsonl, body = documented_catalog()
    items = {tuple(row["token_ids"]): row["item_id"] for row in map(json.loads, jsonl.splitlines())}
    with catalog_server.client(timeout=120) as http:
        reply = http.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    meta = reply.json()["meta_info"]
    rows = meta["item_results"]
    assert len(rows) == body["sampling_params"]["n"]
    for row in rows:
        assert row["is_complete"] and items[tuple(row["token_ids"])] == row["item_id"]
    # http-api.md: completion_tokens is summed over the returned beams, not the top beam's
    beams = meta["beam_results"]
    assert len(beams) > 1
    assert meta["completion_tokens"] == sum(len(b["output_ids"]) for b in beams)
    assert meta["completion_tokens"] > len(reply.json()["output_ids"])
    api = (DOCS / "http-api.md").read_text()
    reply_example = api.index('"e2e_latency": 0.04}}\n```')
    assert "**summed over every returned beam**" in api[reply_example : reply_example + 400]


# How the project was built is no part of its user docs: who measured, what changed since,
# what the code did before. (Words that stay legitimate, e.g. "for now" or a weights "session",
# are not in the list.)
HISTORY = re.compile(
    r"\bhelpers?\b|other sessions|\bsessions?' tests|\bthis (task|change|rule)\b|\bBefore:"
    r"|before th(e|is|ese) changes?|\brerun\b|\bre-run\b|earlier runs?\b|\bold code\b"
    r"|the previous\b[^.]{0,20}\bbuild|\bpredates\b|\bsince then\b"
    r"|\bnow (checks|stages|reads|takes|uses|runs|starts|gives)\b|\bin CI\b.*\(\d+(\.\d+)? s\)",
    re.I,
)
# and in the pages of figures (where a write that "landed" or a log line's "no longer" of the
# other pages is not at home), what a change did to them
FIGURES_HISTORY = re.compile(
    r"\blanded\b|\bno longer\b|\bafter (it|they|this|these) (had )?landed", re.I
)
FIGURE_PAGES = ("README.md", "benchmarks.md", "reliability.md", "security.md")


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in DOCS.glob("*.md"))])
def test_user_docs_state_figures_not_their_history(page):
    text = (REPO_ROOT / page if page == "README.md" else DOCS / page).read_text()
    found = [*HISTORY.finditer(text)]
    if page in FIGURE_PAGES:
        found += FIGURES_HISTORY.finditer(text)
    hits = [f"{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in found]
    assert not hits, f"{page}: {hits}"


def test_cli_md_status_example_is_what_grctl_status_prints(catalog_server):
    block = re.search(r"```console\n\$ grctl status\n(.*?)```", (DOCS / "cli.md").read_text(), re.S)
    out = grctl("status", "--url", catalog_server.url)
    assert out.returncode == 0, out.stdout + out.stderr
    printed = [line.rstrip() for line in out.stdout.splitlines()]
    for line in block.group(1).rstrip().splitlines():
        # the documented line with its numbers (and the URL) as any the server may report
        pattern = re.escape(line.replace("http://127.0.0.1:8000", "URL"))
        pattern = re.sub(r"\d+(\\\.\d+)?", r"\\d+(?:\\.\\d+)?", pattern).replace("URL", ".+")
        assert any(re.fullmatch(pattern, p) for p in printed), (line, printed)

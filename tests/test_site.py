"""The documentation site (docs/, mkdocs.yml): its configuration reference is what the
settings models say, its API reference what the OpenAPI document says, every setting is
documented, and every place in the code, tests and benchmarks that points into the docs
names a page and a heading that exist. The site itself is built with `mkdocs build
--strict` by scripts/check, before any test."""

from __future__ import annotations

import re
from pathlib import Path

from markdown.extensions.toc import slugify

from openalice_scheduler import api_reference
from openalice_scheduler.config import AREAS, Settings
from openalice_scheduler.config.reference import page
from tests.harness import REPO

DOCS = REPO / "docs"
# `docs/<page>.md` or `docs/<page>.md#<anchor>`, as code and tests name the docs.
REFERENCE = re.compile(r"docs/([A-Za-z0-9_/-]+\.md)(?:#([A-Za-z0-9_-]+))?")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*(?:\{#([A-Za-z0-9_-]+)\})?\s*$")


def test_the_configuration_reference_is_what_the_models_say() -> None:
    committed = (DOCS / "reference" / "configuration.md").read_text()
    assert committed == page(), (
        "docs/reference/configuration.md differs from the settings models: run "
        "`python -m openalice_scheduler.config.reference > docs/reference/configuration.md`"
    )


def test_the_api_reference_is_what_the_openapi_document_says() -> None:
    committed = (DOCS / "reference" / "openapi.md").read_text()
    assert committed == api_reference.page(api_reference.document()), (
        "docs/reference/openapi.md differs from the service's OpenAPI document: run "
        "`python -m openalice_scheduler.api_reference > docs/reference/openapi.md`"
    )


def test_every_setting_is_described_in_exactly_one_area() -> None:
    areas = [set(area.model_fields) for _, area in AREAS]
    for name, field in Settings.model_fields.items():
        assert sum(name in fields for fields in areas) == 1, f"{name}: in one area, not more"
        assert field.description, f"{name.upper()} has no description"
    assert set().union(*areas) == set(Settings.model_fields)


def anchors(path: Path) -> set[str]:
    """The headings' anchors of a page, as MkDocs' toc makes them (or given: `{#id}`)."""
    found = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if fenced or not (match := HEADING.match(line)):
            continue
        title, given = match.groups()
        text = re.sub(r"`([^`]*)`", r"\1", title)  # code spans keep their text
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep theirs
        found.add(given or slugify(text, "-"))
    return found


def test_every_reference_to_the_docs_names_a_page_and_heading_that_exist() -> None:
    places = [
        path
        for folder in ("src", "tests", "bench", "scripts", "deploy")
        for path in (REPO / folder).rglob("*")
        if path.is_file() and path.suffix in (".py", ".sh", ".yml", ".yaml", ".md", "")
    ]
    seen = 0
    broken = []
    for path in places:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for match in REFERENCE.finditer(text):
            target, anchor = DOCS / match[1], match[2]
            seen += 1
            where = f"{path.relative_to(REPO)}: {match[0]}"
            if not target.is_file():
                broken.append(f"{where}: no such page")
            elif anchor is not None and anchor not in anchors(target):
                broken.append(f"{where}: no such heading")
    assert not broken, "\n".join(broken)
    assert seen > 50  # the code does point into the docs

"""What a page the service serves loads by its markup (the /docs and /ui tests)."""

from __future__ import annotations

from html.parser import HTMLParser


class _References(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        wanted = {"script": "src", "link": "href"}.get(tag)
        for name, value in attrs:
            if name == wanted and value:
                self.urls.append(value)


def page_references(html: str) -> list[str]:
    """The URLs `html` loads by its markup: script src and link href."""
    references = _References()
    references.feed(html)
    return references.urls

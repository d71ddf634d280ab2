"""--url-prefix values that served the dashboard before 334ec96 still do: any path segment of
letters (any script), digits and the characters RFC 3986 allows in one ('-._~', ':', '@', '+',
',', ';', '=', '!', '$', '*', '(', ')'). 334ec96 refused all but ASCII letters, digits and '-._~',
so such a setup stopped starting at its next restart; what it meant to refuse (a host-relative
'//', a space, quote, '?', '#', '&', '%' or backslash) still is."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote

import pytest

from dashboard.app import create_app

#: what a browser leaves as it is in a path (quote() encodes the rest: the letters of other scripts)
PATH_SAFE = "/:@+,;=!$*()-._~"


@pytest.mark.parametrize(
    "prefix", ["/énergie/", "/仪表板/kvctl/", "/kv:ctl/", "/team@ops/", "/ops+kvctl/", "/a,b;c=d/"]
)
def test_a_url_prefix_that_served_before_still_serves(tmp_path: Path, prefix: str) -> None:
    from kvctl.db.migrate import open_db

    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    open_db(url, auto_upgrade=True).dispose()
    app = create_app(url, url_prefix=prefix)
    try:
        client = app.server.test_client()
        page = client.get(quote(prefix, safe=PATH_SAFE))
        assert page.status_code == 200
        scripts = re.findall(r'<script src="([^"]+)"', page.get_data(as_text=True))
        assert scripts and all(s.startswith(prefix) for s in scripts)
        assert client.get(quote(scripts[0], safe=PATH_SAFE + "?&%")).status_code == 200
        assert client.get(quote(prefix, safe=PATH_SAFE) + "_dash-layout").status_code == 200
    finally:
        app.server.extensions["kvctl"].engine.dispose()


@pytest.mark.parametrize("prefix", ["/a&b/", "/a%20b/", "/a'b/", "/a\\b/", "/a<b/", "/a\u200bb/"])
def test_what_no_path_segment_should_hold_is_still_refused(tmp_path: Path, prefix: str) -> None:
    with pytest.raises(ValueError, match="URL prefix"):
        create_app(f"sqlite:///{tmp_path / 'metrics.db'}", url_prefix=prefix)

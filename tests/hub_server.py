"""A local stand-in for the Hugging Face Hub: the few endpoints huggingface_hub calls to download a repo.

Repos live in memory as a list of commits per repo id; tests add commits and the server answers:
  GET  /api/models/{repo}[/revision/{rev}]          repo info with the commit sha and file list
  GET  /api/models/{repo}/tree/{rev}[/{path}]        the file tree (recursive)
  HEAD /{repo}/resolve/{rev}/{path}                  file metadata (commit, etag, size)
  GET  /{repo}/resolve/{rev}/{path}                  file content
  GET  /api/models?filter=&search=&sort=&limit=       the listing: repos whose README's front matter has the tag
                                                     (filter), whose id holds `search`, by `sort` (downloads,
                                                     likes, lastModified: from `stats`), most first
Every request is recorded, so tests can assert that a cached download made none.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse


class HubRepos:
    def __init__(self) -> None:
        self.commits: dict[str, list[tuple[str, dict[str, bytes]]]] = {}
        self.requests: list[tuple[str, str]] = []
        self.stats: dict[str, dict] = {}  # repo id -> downloads, likes, lastModified (ISO), as the listing gives them

    def tags(self, repo_id: str) -> list[str]:
        """The tags of the newest commit's README front matter (`tags:` as a YAML list of `- name` lines)."""
        readme = self.commits[repo_id][-1][1].get("README.md", b"").decode()
        front = re.match(r"---\n(.*?)\n---", readme, re.S)
        return re.findall(r"^\s*-\s*(\S+)", front.group(1), re.M) if front else []

    def push(self, repo_id: str, files: dict[str, bytes]) -> str:
        """Adds a commit holding exactly `files`; returns its sha."""
        digest = hashlib.sha1(repo_id.encode())
        digest.update(str(len(self.commits.get(repo_id, []))).encode())
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + files[name])
        sha = digest.hexdigest()
        self.commits.setdefault(repo_id, []).append((sha, dict(files)))
        return sha

    def push_dir(self, repo_id: str, directory: Path) -> str:
        files = {
            p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
        }
        return self.push(repo_id, files)

    def resolve(self, repo_id: str, revision: str):
        commits = self.commits.get(repo_id)
        if not commits:
            return None
        if revision == "main":
            return commits[-1]
        return next((c for c in commits if c[0] == revision), None)


def _handler(repos: HubRepos):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output clean
            pass

        def _send(self, status, body=b"", headers=None, error=None):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if error:
                self.send_header("X-Error-Code", error)
                self.send_header("X-Error-Message", error)
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, obj):
            self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            url = urlparse(self.path)
            path = unquote(url.path)
            repos.requests.append((self.command, path))
            if path == "/api/models":
                return self._listing(parse_qs(url.query))
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                return self._info(m.group(1), m.group(2) or "main")
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
            if m:
                return self._tree(m.group(1), m.group(2), m.group(3) or "")
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                return self._file(m.group(1), m.group(2), m.group(3))
            self._send(404, b"not found", error="EntryNotFound")

        def _listing(self, query):
            wanted, words = query.get("filter", []), (query.get("search") or [""])[0].lower()
            sort = (query.get("sort") or ["downloads"])[0]
            found = [r for r in repos.commits if set(wanted) <= set(repos.tags(r)) and words in r.lower()]
            found.sort(key=lambda r: repos.stats.get(r, {}).get(sort) or 0, reverse=True)
            limit = int((query.get("limit") or [len(found)])[0])
            self._json(
                [
                    {
                        "id": r,
                        "modelId": r,
                        "private": False,
                        "tags": repos.tags(r),
                        "downloads": repos.stats.get(r, {}).get("downloads", 0),
                        "likes": repos.stats.get(r, {}).get("likes", 0),
                        "lastModified": repos.stats.get(r, {}).get("lastModified", "2026-01-01T00:00:00.000Z"),
                    }
                    for r in found[:limit]
                ]
            )

        def _commit(self, repo_id, revision):
            if repo_id not in repos.commits:
                self._send(404, b"repo not found", error="RepoNotFound")
                return None
            commit = repos.resolve(repo_id, revision)
            if commit is None:
                self._send(404, b"revision not found", error="RevisionNotFound")
            return commit

        def _info(self, repo_id, revision):
            commit = self._commit(repo_id, revision)
            if commit:
                sha, files = commit
                self._json(
                    {
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": sha,
                        "private": False,
                        "siblings": [{"rfilename": n} for n in sorted(files)],
                        "tags": [],
                    }
                )

        def _tree(self, repo_id, revision, prefix):
            commit = self._commit(repo_id, revision)
            if commit:
                _, files = commit
                self._json(
                    [
                        {"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                        for n, b in sorted(files.items())
                        if n.startswith(prefix)
                    ]
                )

        def _file(self, repo_id, revision, name):
            commit = self._commit(repo_id, revision)
            if not commit:
                return
            sha, files = commit
            if name not in files:
                return self._send(404, b"entry not found", {"X-Repo-Commit": sha}, error="EntryNotFound")
            body = files[name]
            self._send(
                200,
                body,
                {
                    "X-Repo-Commit": sha,
                    "ETag": f'"{hashlib.sha256(body).hexdigest()}"',
                    "Content-Length": str(len(body)),
                    "Content-Type": "application/octet-stream",
                },
            )

    return Handler


class HubServer:
    def __init__(self) -> None:
        self.repos = HubRepos()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.repos))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> "HubServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

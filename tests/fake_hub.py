"""A stand-in for the Hugging Face Hub on 127.0.0.1 (never the network): the endpoints `HfApi.create_repo`,
`file_exists`, `upload_folder` and `snapshot_download` call, answering as the Hub does (a missing file is a
404 with `X-Error-Code: EntryNotFound`). Files are kept per repo, so several repos can be pushed and pulled.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class FakeHub(BaseHTTPRequestHandler):
    """The endpoints HfApi.create_repo, file_exists and upload_folder call (xet disabled): create,
    validate-yaml, preupload (everything uploads inline as "regular") and the NDJSON commit (added and deleted
files); and those of
    snapshot_download: revision info, the file tree, then HEAD + GET per file."""

    requests: list[tuple[str, dict]] = []
    repos: dict[str, dict[str, bytes]] = {}  # repo id -> file path -> bytes
    heads: dict[str, str] = {}  # repo id -> its last commit's sha (a new one per commit, as on the Hub)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        root = f"http://127.0.0.1:{self.server.server_address[1]}"
        FakeHub.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
        if self.path == "/api/repos/create":
            spec = json.loads(body)
            FakeHub.repos.setdefault(f"{spec['organization']}/{spec['name']}", {})
            self.reply({"url": f"{root}/{spec['organization']}/{spec['name']}", **spec})
        elif self.path == "/api/validate-yaml":
            self.reply({})
        elif "/preupload/" in self.path:
            modes = [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                for f in json.loads(body)["files"]
            ]
            self.reply({"files": modes})
        elif "/commit/" in self.path:
            repo = self.path.split("/api/models/")[1].split("/commit/")[0]
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    FakeHub.repos[repo][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] == "deletedFile":
                    del FakeHub.repos[repo][item["value"]["path"]]
            sha = hashlib.sha1(f"{repo}:{len(FakeHub.requests)}".encode()).hexdigest()
            FakeHub.heads[repo] = sha
            self.reply({"commitUrl": f"{root}/{repo}/commit/{sha}", "commitOid": sha})
        else:
            self.reply({"error": f"unexpected {self.path}"}, 404)

    def do_HEAD(self) -> None:
        self.do_GET(head=True)

    def do_GET(self, head: bool = False) -> None:
        FakeHub.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
        path = self.path.split("?")[0]
        if "/resolve/" in path:
            repo, rest = path.lstrip("/").split("/resolve/")
            data = FakeHub.repos.get(repo, {}).get(rest.split("/", 1)[1])
            if data is None:  # the Hub's answer for a file that is not in the repo
                return self.reply({"error": "Entry not found"}, 404, {"X-Error-Code": "EntryNotFound"})
            self.send_response(200)
            self.send_header("X-Repo-Commit", FakeHub.heads.get(repo, "a" * 40))
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)
            return None
        repo = path.split("/api/models/")[-1].split("/tree/")[0].split("/revision/")[0]
        if repo not in FakeHub.repos:
            return self.reply({"error": "Repository not found"}, 404, {"X-Error-Code": "RepositoryNotFound"})
        files = FakeHub.repos[repo]
        if "/tree/" in path:
            tree = [
                {"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for n, b in files.items()
            ]
            self.reply(tree)
        elif "/revision/" in path:
            siblings = [{"rfilename": name} for name in files]
            self.reply({"id": repo, "sha": FakeHub.heads.get(repo, "a" * 40), "siblings": siblings})
        else:
            self.reply({"error": f"unexpected {self.path}"}, 404)

    def reply(self, payload: dict | list, status: int = 200, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(name="fake_hub")
def fake_hub_fixture(monkeypatch, tmp_path):
    """The stand-in's endpoint URL; a test importing this function can ask for `fake_hub`."""
    import huggingface_hub.constants

    # The stand-in speaks the plain commit API; with xet the upload goes to a CAS server instead.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no saved login leaks in
    # Downloads go to this test's own cache (the constant was read when huggingface_hub was imported).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    FakeHub.requests, FakeHub.repos, FakeHub.heads = [], {}, {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()



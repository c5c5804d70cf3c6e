"""An in-memory Google Cloud Storage for tests: one object store, reached the two ways a `gs://`
workdir is reached in production.

- `FakeGCSFileSystem`, an fsspec file system for the `gs`/`gcs` protocols: what `etils.epath`
  uses for `gs://` paths (its fsspec backend, in place of gcsfs). Object semantics, as GCS
  without hierarchical namespace: a "folder" is a name prefix (it exists while an object is under
  it; mkdir creates nothing), an object is written whole when its file is closed, there is no
  append (mode "a" raises), and a move is a copy and a delete.
- `serve()`, a local HTTP server answering the subset of the GCS JSON API that TensorStore's `gcs`
  driver (Orbax's array writes) uses: media uploads with `ifGenerationMatch`, media downloads
  with byte ranges and generation conditions, listing by key range, deletes. TensorStore is
  pointed at it with TENSORSTORE_GCS_HTTP_URL (and GOOGLE_AUTH_TOKEN_FOR_TESTING for auth).

`Store.fail_writes(name_suffix)` makes every later write of a matching object fail, as a full
quota or a lost connection would.
"""

from __future__ import annotations

import io
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fsspec.spec import AbstractFileSystem


class Store:
    """{(bucket, object name): (bytes, generation)}, shared by the file system and the server."""

    def __init__(self):
        self.objects: dict[tuple[str, str], tuple[bytes, int]] = {}
        self.lock = threading.Lock()
        self.generation = 0
        self.failing: list[str] = []

    def put(self, bucket: str, name: str, data: bytes) -> int:
        with self.lock:
            if any(name.endswith(suffix) for suffix in self.failing):
                raise OSError(f"fake GCS: write of gs://{bucket}/{name} failed (quota exceeded)")
            self.generation += 1
            self.objects[bucket, name] = (bytes(data), self.generation)
            return self.generation

    def fail_writes(self, name_suffix: str) -> None:
        self.failing.append(name_suffix)

    def names(self, bucket: str, prefix: str = "") -> list[str]:
        with self.lock:
            return sorted(n for b, n in self.objects if b == bucket and n.startswith(prefix))

    def clear(self) -> None:
        with self.lock:
            self.objects.clear()
            self.failing.clear()


def _split(path: str) -> tuple[str, str]:
    bucket, _, name = path.partition("/")
    return bucket, name


class _Upload(io.BytesIO):
    """A file open for writing: the object is written, whole, when it is closed."""

    def __init__(self, store: Store, bucket: str, name: str):
        super().__init__()
        self._target = store, bucket, name

    def close(self):
        if not self.closed:
            store, bucket, name = self._target
            data = self.getvalue()
            super().close()
            store.put(bucket, name, data)


class FakeGCSFileSystem(AbstractFileSystem):
    """fsspec's view of the fake store for `gs://bucket/name` (see the module docstring)."""

    protocol = ("gs", "gcs")
    cachable = False

    def __init__(self, store: Store, **kwargs):
        super().__init__(**kwargs)
        self.store = store

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                path = path[len(prefix) :]
        return path.rstrip("/")

    def info(self, path, **kwargs):
        bucket, name = _split(self._strip_protocol(path))
        with self.store.lock:
            found = self.store.objects.get((bucket, name))
        if found is not None and name:
            return {"name": f"{bucket}/{name}", "size": len(found[0]), "type": "file"}
        if not name or self.store.names(bucket, name + "/"):
            return {"name": f"{bucket}/{name}".rstrip("/"), "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def ls(self, path, detail=True, **kwargs):
        path = self._strip_protocol(path)
        bucket, name = _split(path)
        entry = self.info(path)
        if entry["type"] == "file":
            return [entry] if detail else [entry["name"]]
        prefix = f"{name}/" if name else ""
        children = {}
        for full in self.store.names(bucket, prefix):
            child, _, rest = full[len(prefix) :].partition("/")
            key = f"{bucket}/{prefix}{child}"
            if rest:
                children[key] = {"name": key, "size": 0, "type": "directory"}
            else:
                children[key] = self.info(key)
        entries = [children[k] for k in sorted(children)]
        return entries if detail else [e["name"] for e in entries]

    def _open(self, path, mode="rb", **kwargs):
        bucket, name = _split(self._strip_protocol(path))
        if mode == "rb":
            with self.store.lock:
                found = self.store.objects.get((bucket, name))
            if found is None:
                raise FileNotFoundError(path)
            return io.BytesIO(found[0])
        if mode == "wb":
            return _Upload(self.store, bucket, name)
        raise NotImplementedError(f"fake GCS: mode {mode!r} (objects are written whole)")

    def cp_file(self, path1, path2, **kwargs):
        bucket, name = _split(self._strip_protocol(path1))
        with self.store.lock:
            data = self.store.objects[bucket, name][0]
        self.store.put(*_split(self._strip_protocol(path2)), data)

    def rm_file(self, path):
        bucket, name = _split(self._strip_protocol(path))
        with self.store.lock:
            if self.store.objects.pop((bucket, name), None) is None:
                raise FileNotFoundError(path)

    def rm(self, path, recursive=False, maxdepth=None):
        paths = path if isinstance(path, list) else [path]
        for one in paths:
            bucket, name = _split(self._strip_protocol(one))
            with self.store.lock:
                keys = [
                    (b, n)
                    for b, n in self.store.objects
                    if b == bucket and (n == name or (recursive and n.startswith(name + "/")))
                ]
                if not keys:
                    raise FileNotFoundError(one)
                for key in keys:
                    del self.store.objects[key]

    def mkdir(self, path, create_parents=True, **kwargs):
        pass  # a folder is a name prefix

    def makedirs(self, path, exist_ok=False):
        pass

    def rmdir(self, path):
        pass


class _Handler(BaseHTTPRequestHandler):
    """The GCS JSON API calls of TensorStore's gcs driver, on `self.server.store`."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, value) -> None:
        self._reply(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def _request(self):
        url = urllib.parse.urlsplit(self.path)
        return url.path.split("/"), dict(urllib.parse.parse_qsl(url.query))

    def _metadata(self, bucket: str, name: str, data: bytes, generation: int) -> dict:
        return {
            "kind": "storage#object",
            "bucket": bucket,
            "name": name,
            "size": str(len(data)),
            "generation": str(generation),
            "metageneration": "1",
            "updated": "2026-01-01T00:00:00.000Z",
        }

    def _precondition(self, query: dict, current: tuple[bytes, int] | None) -> int | None:
        generation = current[1] if current else 0
        if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != generation:
            return 412
        if "ifGenerationNotMatch" in query and int(query["ifGenerationNotMatch"]) == generation:
            return 304
        return None

    def do_GET(self):  # noqa: N802 - http.server's name
        parts, query = self._request()
        store = self.server.store
        if len(parts) >= 7 and parts[5] == "o":  # /storage/v1/b/BUCKET/o/NAME
            bucket, name = parts[4], urllib.parse.unquote("/".join(parts[6:]))
            with store.lock:
                current = store.objects.get((bucket, name))
            if current is None:
                return self._reply(404, b'{"error": {"code": 404}}')
            if (code := self._precondition(query, current)) is not None:
                return self._reply(code)
            data, generation = current
            if query.get("alt") != "media":
                return self._json(self._metadata(bucket, name, data, generation))
            headers, code = {"x-goog-generation": str(generation)}, 200
            if byte_range := self.headers.get("Range"):
                first, last = byte_range.split("=")[1].split("-")
                first, last = int(first), int(last) if last else len(data) - 1
                headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
                data, code = data[first : last + 1], 206
            return self._reply(code, data, headers)
        if len(parts) == 6 and parts[5] == "o":  # /storage/v1/b/BUCKET/o: list
            bucket = parts[4]
            start, end = query.get("startOffset"), query.get("endOffset")
            with store.lock:
                items = [
                    self._metadata(b, n, *store.objects[b, n])
                    for b, n in sorted(store.objects)
                    if b == bucket
                    and n.startswith(query.get("prefix", ""))
                    and (start is None or n >= start)
                    and (end is None or n < end)
                ]
            return self._json({"kind": "storage#objects", "items": items})
        if len(parts) == 5:  # /storage/v1/b/BUCKET
            return self._json({"kind": "storage#bucket", "name": parts[4]})
        return self._reply(400)

    def do_POST(self):  # noqa: N802 - /upload/storage/v1/b/BUCKET/o?uploadType=media&name=NAME
        parts, query = self._request()
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        bucket, name, store = parts[5], query["name"], self.server.store
        with store.lock:
            current = store.objects.get((bucket, name))
        if self._precondition(query, current) is not None:
            return self._reply(412)
        try:
            generation = store.put(bucket, name, body)
        except OSError:
            return self._reply(403, b'{"error": {"code": 403}}')
        return self._json(self._metadata(bucket, name, body, generation))

    def do_DELETE(self):  # noqa: N802 - /storage/v1/b/BUCKET/o/NAME
        parts, query = self._request()
        bucket, name = parts[4], urllib.parse.unquote("/".join(parts[6:]))
        store = self.server.store
        with store.lock:
            current = store.objects.get((bucket, name))
            if current is None:
                return self._reply(404)
            if self._precondition(query, current) is not None:
                return self._reply(412)
            del store.objects[bucket, name]
        return self._reply(204)


def serve(store: Store) -> ThreadingHTTPServer:
    """Starts the HTTP server on a free loopback port, in a daemon thread."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.store = store
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server

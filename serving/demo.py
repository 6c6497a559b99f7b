"""Ask a running ``streamrec serve`` for scores of a real MovieLens user (the last step of ``make demo``).

    python -m serving.demo --url http://127.0.0.1:18080 --user 1m_1 --k 5

The request carries what the joiner put on that user's samples: the user's attributes as context and,
per candidate movie, its release year and genres (serving keeps no item store). Candidates are the
user's own first rated movies, then popular ones, then the data set's most rated ones. Prints one line per
candidate, and the model version and delta sequence number that answered.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any


def build_request(dataset: str, user: str, k: int) -> dict[str, Any]:
    from stream.replay.movielens import read_movielens

    tables = read_movielens(dataset)
    users, items = tables.user_attrs, tables.item_attrs
    if user not in users:
        raise SystemExit(f"user {user!r} is not in {dataset} (ids look like {next(iter(users))!r})")
    rated = [i for u, i in zip(tables.user_ids.to_pylist(), tables.item_ids.to_pylist(), strict=True)
             if u == user][: max(1, k // 2)]
    popular = [i for i in ("American Beauty (1999)", "Star Wars: Episode IV - A New Hope (1977)",
                           "Jurassic Park (1993)", "Fargo (1996)", "Toy Story (1995)", "Heat (1995)") if i in items]
    # then the data set's most rated items, so there are k on either data set (ml-100k's ids are numbers, not titles)
    most_rated = Counter(tables.item_ids.to_pylist()).most_common(k + len(rated) + len(popular))
    candidates = list(dict.fromkeys(rated + popular + [i for i, _ in most_rated]))[:k]
    return {"user_id": user, "context": users[user],
            "items": [{"item_id": i, "context": items.get(i, {})} for i in candidates]}


def post(url: str, body: dict[str, Any], wait_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + wait_s
    while True:  # the server may still be loading its artifact
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not become ready within {wait_s:.0f} s")
        time.sleep(0.2)
    req = urllib.request.Request(f"{url}/v1/score", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"POST /v1/score: {exc.code} {exc.read().decode(errors='replace')}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the serving process (default %(default)s)")
    p.add_argument("--dataset", default="ml-1m")
    p.add_argument("--user", default="1m_1", help="a MovieLens user id as replay publishes it (default %(default)s)")
    p.add_argument("--k", type=int, default=5, help="candidates (default %(default)s)")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for /readyz (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the response as JSON")
    args = p.parse_args(argv)
    body = build_request(args.dataset, args.user, args.k)
    resp = post(args.url.rstrip("/"), body, args.wait)
    if args.json:
        print(json.dumps({"request": body, "response": resp}))
        return 0
    print(f"user {args.user} ({body['context']}): model {resp['model_version']}, delta {resp['delta_seq']}")
    for item, score in zip(body["items"], resp["scores"], strict=True):
        print(f"  {score:.4f}  {item['item_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

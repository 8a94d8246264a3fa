"""A real PyTorch TCPStore server for the tests of dtrain's c10d client (test_c10d_store.cpp).

Usage: python tcpstore_server.py [default|classic]
  default: TCPStore(is_master=True) as torch builds it (libuv backend on torch >= 2.4)
  classic: use_libuv=False (the poll-based backend), where torch has the option

Prints one line "@PORT <port> TORCH <version> LIBUV <0|1>" once the server listens, then
answers commands read from stdin, one per line, each with one line (shown here without the
"@" that starts every line of this script's own; other lines are torch's log):
  set KEY HEX           -> OK                 (the server process's own client sets KEY)
  get KEY               -> VALUE HEX
  setrandom KEY N       -> SHA <sha256 hex>   (N random bytes)
  sha KEY               -> SHA <len> <sha256 hex>
  numkeys               -> NUMKEYS <n>
Keys are what a torch client names them (torch's client adds a leading '/' on the wire).
It exits at the end of its input.
"""
import datetime
import hashlib
import os
import sys

import torch
import torch.distributed as dist


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "default"
    kw = dict(is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=20))
    if mode == "classic":
        kw["use_libuv"] = False
    store = dist.TCPStore("127.0.0.1", 0, **kw)
    libuv = 1 if getattr(store, "libuvBackend", False) else 0
    print(f"@PORT {store.port} TORCH {torch.__version__} LIBUV {libuv}", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        cmd = parts[0]
        if cmd == "set":
            store.set(parts[1], bytes.fromhex(parts[2]) if len(parts) > 2 else b"")
            out = "OK"
        elif cmd == "get":
            out = "VALUE " + store.get(parts[1]).hex()
        elif cmd == "setrandom":
            data = os.urandom(int(parts[2]))
            store.set(parts[1], data)
            out = "SHA " + hashlib.sha256(data).hexdigest()
        elif cmd == "sha":
            data = store.get(parts[1])
            out = f"SHA {len(data)} {hashlib.sha256(data).hexdigest()}"
        elif cmd == "numkeys":
            out = f"NUMKEYS {store.num_keys()}"
        else:
            out = "ERROR unknown command " + cmd
        print("@" + out, flush=True)


if __name__ == "__main__":
    main()

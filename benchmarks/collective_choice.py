"""Benchmark: torch.distributed (gloo) inside Ray actors vs ray.util.collective.

Measures, for point-to-point transfers between two Ray actors on one machine:

  A  torch.distributed process group created inside the actors the way Ray
     Train does it (rank 0 picks MASTER_ADDR/port, every actor calls
     dist.init_process_group(backend="gloo", init_method="tcp://addr:port",
     rank=..., world_size=..., timeout=...)).
  B  ray.util.collective with backend "gloo" (init_collective_group inside the
     actors; in Ray 2.60 this is TorchGLOOGroup = torch.distributed gloo).
  B2 ray.util.collective.create_collective_group (declarative, driver side;
     group created lazily on the first collective call), set-up only.
  ref  Ray object store hand-off (ray.put in actor 0, ray.get in actor 1) and
     one-core torch memcpy, for reference.

Usage:  python benchmarks/collective_choice.py [--json] [--address ADDR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from datetime import timedelta

import ray

MB = 1 << 20
SIZES_MB = (64, 256)
DTYPES = ("float32", "uint8")
REPS = 5
PG_TIMEOUT_S = 60
TIMEOUT_PROBE_S = 2


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:2000]


@ray.remote(num_cpus=1)
class Peer:
    """One benchmark participant. torch is imported inside the actor."""

    def __init__(self, rank: int, world_size: int):
        import torch

        torch.set_num_threads(1)
        self.rank = rank
        self.world_size = world_size
        self.bufs = {}

    # ------------------------------------------------------------ helpers
    def info(self):
        import torch

        return {
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "torch": torch.__version__,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        }

    def pick_master(self):
        """Rank 0 side: node IP + a free port (bind port 0, close, hand out).

        Same approach as Ray Train / ray.util.collective: there is a small
        race between closing the probe socket and gloo's TCPStore binding it.
        """
        addr = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
        return addr, port

    def _buf(self, size_mb: int, dtype: str):
        import torch

        key = (size_mb, dtype)
        if key not in self.bufs:
            dt = getattr(torch, dtype)
            n = size_mb * MB // torch.empty((), dtype=dt).element_size()
            t = torch.empty(n, dtype=dt)
            t.zero_()  # fault the pages in so first-touch is not timed
            self.bufs[key] = t
        return self.bufs[key]

    def free_bufs(self):
        self.bufs.clear()
        return True

    # -------------------------------------------------------- option A
    def init_torch_pg(self, addr: str, port: int, timeout_s: float):
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        t1 = time.perf_counter()
        # First op: gloo pairs are connected in init, but measure anyway.
        import torch

        x = torch.zeros(1)
        if self.rank == 0:
            dist.send(x, dst=1)
        else:
            dist.recv(x, src=0)
        t2 = time.perf_counter()
        return {"init_s": t1 - t0, "first_op_s": t2 - t1}

    def timeout_probe(self, timeout_s: float):
        """Rank 1 waits on a recv that rank 0 never sends, in a subgroup with
        a short timeout. Returns elapsed time and the error raised."""
        import torch
        import torch.distributed as dist

        g = dist.new_group(ranks=[0, 1], timeout=timedelta(seconds=timeout_s))
        out = {"rank": self.rank}
        if self.rank == 1:
            x = torch.zeros(4)
            t0 = time.perf_counter()
            try:
                dist.recv(x, src=0, group=g)
                out["error"] = None
            except Exception as e:  # noqa: BLE001
                out["error"] = _err(e)
            out["elapsed_s"] = time.perf_counter() - t0
        # Do not destroy the subgroup: a pending op may keep it busy. It dies
        # with the actor.
        return out

    def p2p(self, backend: str, size_mb: int, dtype: str, mode: str, reps: int, group_name: str = "default"):
        """Time `reps` transfers rank0 -> rank1. Each rep starts after a
        barrier; per-rep time is recorded on each side (driver takes max)."""
        import torch.distributed as dist

        if backend == "B":
            import ray.util.collective as col

        buf = self._buf(size_mb, dtype)
        times, ok = [], True
        for r in range(reps):
            val = (r * 7 + 3) % 100
            if self.rank == 0:
                buf.fill_(val)
            else:
                buf.fill_(255 if dtype == "uint8" else -1)
            if backend == "A":
                dist.barrier()
            else:
                col.barrier(group_name)
            t0 = time.perf_counter()
            if backend == "A":
                if mode == "sendrecv":
                    if self.rank == 0:
                        dist.send(buf, dst=1)
                    else:
                        dist.recv(buf, src=0)
                else:  # isend/irecv
                    if self.rank == 0:
                        w = dist.isend(buf, dst=1)
                    else:
                        w = dist.irecv(buf, src=0)
                    w.wait()
            else:
                if self.rank == 0:
                    col.send(buf, 1, group_name)
                else:
                    col.recv(buf, 0, group_name)
            times.append(time.perf_counter() - t0)
            if self.rank == 1:
                ok &= bool(buf[0].item() == val and buf[-1].item() == val)
        return {"times": times, "ok": ok}

    # -------------------------------------------------------- option B
    def init_ray_collective(self, group_name: str, timeout_ms: int):
        import ray.util.collective as col

        t0 = time.perf_counter()
        col.init_collective_group(
            world_size=self.world_size,
            rank=self.rank,
            backend="gloo",
            group_name=group_name,
            gloo_timeout=timeout_ms,
        )
        t1 = time.perf_counter()
        import torch

        x = torch.zeros(1)
        if self.rank == 0:
            col.send(x, 1, group_name)
        else:
            col.recv(x, 0, group_name)
        t2 = time.perf_counter()
        g = col.get_group_handle(group_name)
        return {
            "init_s": t1 - t0,
            "first_op_s": t2 - t1,
            "group_class": f"{type(g).__module__}.{type(g).__name__}",
        }

    def lazy_collective_first_op(self, group_name: str):
        """B2: group declared by create_collective_group on the driver; it is
        built on the first call in each actor."""
        import ray.util.collective as col
        import torch

        x = torch.zeros(1)
        t0 = time.perf_counter()
        if self.rank == 0:
            col.send(x, 1, group_name)
        else:
            col.recv(x, 0, group_name)
        return {"first_op_incl_init_s": time.perf_counter() - t0}

    def destroy(self, which: str, group_name: str = "default"):
        try:
            if which == "B":
                import ray.util.collective as col

                col.destroy_collective_group(group_name)
            else:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            return None
        except Exception as e:  # noqa: BLE001
            return _err(e)

    # -------------------------------------------------------- references
    def memcpy(self, size_mb: int, reps: int):
        import torch

        src = self._buf(size_mb, "uint8")
        dst = torch.empty_like(src)
        dst.zero_()
        src.fill_(1)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        del dst
        return times

    def obj_put(self, size_mb: int):
        src = self._buf(size_mb, "uint8")
        src.fill_(42)
        t0 = time.perf_counter()
        ref = ray.put(src.numpy())
        return [ref], time.perf_counter() - t0

    def obj_get(self, refs, size_mb: int):
        import numpy as np

        dst = self._buf(size_mb, "uint8")
        dst.fill_(0)
        t0 = time.perf_counter()
        arr = ray.get(refs[0])  # zero-copy, read-only view of shared memory
        t1 = time.perf_counter()
        np.copyto(dst.numpy(), arr)
        t2 = time.perf_counter()
        ok = bool(dst[0].item() == 42 and dst[-1].item() == 42)
        del arr
        return {"get_s": t1 - t0, "copy_s": t2 - t1, "ok": ok}


# ---------------------------------------------------------------- driver


def _stats(size_mb: int, times):
    gb = size_mb * MB / 1e9
    return {
        "best_gbps": round(gb / min(times), 3),
        "median_gbps": round(gb / statistics.median(times), 3),
        "best_s": round(min(times), 4),
        "median_s": round(statistics.median(times), 4),
        "n": len(times),
    }


def _run_p2p(actors, backend, modes, group_name="default"):
    out = {}
    for mode in modes:
        for size in SIZES_MB:
            for dt in DTYPES:
                res = ray.get([a.p2p.remote(backend, size, dt, mode, REPS, group_name) for a in actors])
                per_rep = [max(a, b) for a, b in zip(res[0]["times"], res[1]["times"])]
                st = _stats(size, per_rep)
                st["data_ok"] = res[1]["ok"]
                out[f"{mode}/{size}MB/{dt}"] = st
        ray.get([a.free_bufs.remote() for a in actors])
    return out


def _new_pair():
    t0 = time.perf_counter()
    actors = [Peer.remote(r, 2) for r in range(2)]
    infos = ray.get([a.info.remote() for a in actors])
    return actors, infos, time.perf_counter() - t0


def _kill(actors):
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001
            pass


def bench_a(result):
    r = result["A_torch_dist"] = {}
    actors, infos, t_start = _new_pair()
    r["actor_start_s"] = round(t_start, 3)
    result.setdefault("env", {})["actor_info"] = infos
    try:
        t0 = time.perf_counter()
        addr, port = ray.get(actors[0].pick_master.remote())
        inits = ray.get([a.init_torch_pg.remote(addr, port, PG_TIMEOUT_S) for a in actors])
        r["setup_total_s"] = round(time.perf_counter() - t0, 4)
        r["master"] = f"{addr}:{port}"
        r["init_process_group_s"] = [round(i["init_s"], 4) for i in inits]
        r["first_op_s"] = [round(i["first_op_s"], 4) for i in inits]
        r["p2p"] = _run_p2p(actors, "A", ("sendrecv", "isend_irecv"))
        # Reference: memcpy and object store, done in the same actors.
        mc = ray.get(actors[0].memcpy.remote(256, REPS))
        result["memcpy_1core_256MB"] = _stats(256, mc)
        result["memcpy_1core_256MB"]["note"] = "GB/s of bytes copied (memory traffic is ~2x: read+write)"
        ray.get([a.free_bufs.remote() for a in actors])
        ob = []
        for size in SIZES_MB:
            rows = []
            for _ in range(3):
                refs, put_s = ray.get(actors[0].obj_put.remote(size))
                g = ray.get(actors[1].obj_get.remote(refs, size))
                rows.append((put_s, g["get_s"], g["copy_s"], g["ok"]))
                del refs
            tot = [p + gg + c for p, gg, c, _ in rows]
            st = _stats(size, tot)
            st["put_s_best"] = round(min(x[0] for x in rows), 4)
            st["get_s_best"] = round(min(x[1] for x in rows), 4)
            st["copy_s_best"] = round(min(x[2] for x in rows), 4)
            st["data_ok"] = all(x[3] for x in rows)
            ob.append((f"{size}MB", st))
        result["ray_object_store_put_get_copy"] = dict(ob)
        ray.get([a.free_bufs.remote() for a in actors])
        # Timeout behaviour (last, since it leaves a subgroup with a dead op).
        probe = ray.get([a.timeout_probe.remote(TIMEOUT_PROBE_S) for a in actors])
        p = probe[1]
        r["timeout_probe"] = {
            "configured_s": TIMEOUT_PROBE_S,
            "elapsed_s": round(p["elapsed_s"], 3),
            "error": p["error"],
        }
        r["destroy_errors"] = [e for e in ray.get([a.destroy.remote("A") for a in actors]) if e]
    except Exception as e:  # noqa: BLE001
        r["error"] = _err(e)
        r["traceback"] = traceback.format_exc()[-3000:]
    finally:
        _kill(actors)


def bench_b(result):
    r = result["B_ray_util_collective"] = {}
    try:
        import ray.util.collective as col

        r["module"] = col.__file__
        r["gloo_available"] = col.gloo_available()
        r["nccl_available"] = col.nccl_available()
        r["has_isend_irecv_api"] = hasattr(col, "isend") or hasattr(col, "irecv")
    except Exception as e:  # noqa: BLE001
        r["import_error"] = _err(e)
        return
    actors, _, t_start = _new_pair()
    r["actor_start_s"] = round(t_start, 3)
    try:
        t0 = time.perf_counter()
        inits = ray.get([a.init_ray_collective.remote("bench_b", PG_TIMEOUT_S * 1000) for a in actors])
        r["setup_total_s"] = round(time.perf_counter() - t0, 4)
        r["init_collective_group_s"] = [round(i["init_s"], 4) for i in inits]
        r["first_op_s"] = [round(i["first_op_s"], 4) for i in inits]
        r["group_class"] = inits[0]["group_class"]
        r["p2p"] = _run_p2p(actors, "B", ("sendrecv",), "bench_b")
        r["destroy_errors"] = [e for e in ray.get([a.destroy.remote("B", "bench_b") for a in actors]) if e]
    except Exception as e:  # noqa: BLE001
        r["error"] = _err(e)
        r["traceback"] = traceback.format_exc()[-3000:]
    finally:
        _kill(actors)

    # B2: declarative create_collective_group from the driver.
    r2 = result["B2_create_collective_group"] = {}
    actors, _, _ = _new_pair()
    name = "bench_b2"
    try:
        import ray.util.collective as col

        t0 = time.perf_counter()
        col.create_collective_group(
            actors,
            2,
            [0, 1],
            backend="gloo",
            group_name=name,
            gloo_timeout=PG_TIMEOUT_S * 1000,
        )
        t1 = time.perf_counter()
        fo = ray.get([a.lazy_collective_first_op.remote(name) for a in actors])
        r2["declare_s"] = round(t1 - t0, 4)
        r2["first_op_incl_init_s"] = [round(x["first_op_incl_init_s"], 4) for x in fo]
        r2["setup_total_s"] = round(time.perf_counter() - t0, 4)
        r2["destroy_errors"] = [e for e in ray.get([a.destroy.remote("B", name) for a in actors]) if e]
    except Exception as e:  # noqa: BLE001
        r2["error"] = _err(e)
        r2["traceback"] = traceback.format_exc()[-3000:]
    finally:
        _kill(actors)
        # create_collective_group leaves a *detached* named actor "info_<name>";
        # destroy_collective_group inside the actors kills it, but make sure.
        try:
            ray.kill(ray.get_actor("info_" + name))
        except Exception:  # noqa: BLE001
            pass


def print_table(res):
    w = sys.stdout.write
    env = res["env"]
    w(
        f"ray {env['ray']}  torch {env['torch']}  cpus={env['os_cpus']}  "
        f"node_ip={env.get('node_ip')}  total {res['total_runtime_s']} s\n\n"
    )
    for key, title in (
        ("A_torch_dist", "A: torch.distributed gloo in actors"),
        ("B_ray_util_collective", "B: ray.util.collective gloo"),
    ):
        r = res.get(key, {})
        w(f"== {title}\n")
        for k in (
            "group_class",
            "master",
            "actor_start_s",
            "setup_total_s",
            "init_process_group_s",
            "init_collective_group_s",
            "first_op_s",
        ):
            if k in r:
                w(f"  {k:<24} {r[k]}\n")
        if "p2p" in r:
            w(f"  {'transfer':<28}{'best GB/s':>10}{'median GB/s':>13}{'best s':>9}{'ok':>5}\n")
            for name, st in r["p2p"].items():
                w(
                    f"  {name:<28}{st['best_gbps']:>10.3f}{st['median_gbps']:>13.3f}"
                    f"{st['best_s']:>9.4f}{str(st['data_ok']):>5}\n"
                )
        for k in ("timeout_probe", "error", "destroy_errors"):
            if r.get(k):
                v = r[k]
                if k == "error":  # keep the table readable; --json has all
                    v = " | ".join(x for x in str(v).splitlines()[-3:] if x)
                w(f"  {k}: {v}\n")
        w("\n")
    r2 = res.get("B2_create_collective_group", {})
    w("== B2: create_collective_group (lazy init on first op)\n")
    for k, v in r2.items():
        if k != "traceback" and v not in ([], None):
            w(f"  {k:<24} {v}\n")
    w("\n== reference\n")
    mc = res.get("memcpy_1core_256MB")
    if mc:
        w(f"  memcpy 1 core 256MB         best {mc['best_gbps']:.3f} GB/s  median {mc['median_gbps']:.3f} GB/s\n")
    for size, st in res.get("ray_object_store_put_get_copy", {}).items():
        w(
            f"  object store put+get+copy {size:<6} best {st['best_gbps']:.3f} GB/s  "
            f"median {st['median_gbps']:.3f} GB/s  (put {st['put_s_best']} s, "
            f"get {st['get_s_best']} s, copy {st['copy_s_best']} s, ok {st['data_ok']})\n"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--address", default=None, help="existing Ray cluster address")
    args = ap.parse_args()

    t_all = time.perf_counter()
    if args.address:
        ray.init(address=args.address, include_dashboard=False, log_to_driver=False, namespace="collective_choice")
    else:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="collective_choice")
    import torch

    res = {
        "env": {
            "ray": ray.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "os_cpus": os.cpu_count(),
            "node_ip": ray.util.get_node_ip_address(),
            "sizes_mb": list(SIZES_MB),
            "reps": REPS,
        }
    }
    try:
        bench_a(res)
        bench_b(res)
    finally:
        ray.shutdown()
    res["total_runtime_s"] = round(time.perf_counter() - t_all, 2)
    if args.json:
        print(json.dumps(res, indent=1, default=str))
    else:
        print_table(res)


if __name__ == "__main__":
    main()

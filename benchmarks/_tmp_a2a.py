import time, statistics, torch, torch.distributed as dist
import _common as bench
def fn(rank, world):
    torch.set_num_threads(1)
    n = 4 * 1024 * 1024; s = n // world
    inp = torch.randn(n); recv = torch.empty(n); out = torch.empty(s)
    recv_v = torch.empty(n - s)
    def full():
        dist.all_to_all_single(recv, inp); torch.sum(recv.view(world, -1), 0, out=out); out.div_(world)
    def v():
        outs = [0 if r == rank else s for r in range(world)]
        ins = [0 if r == rank else s for r in range(world)]
        dist.all_to_all_single(recv_v, inp, outs, ins)
        others = recv_v.view(world - 1, -1)
        torch.add(inp[rank*s:(rank+1)*s], others.sum(0) if world > 2 else others[0], out=out); out.div_(world)
    def rs():
        dist.reduce_scatter_single(out, inp); out.div_(world)
    res = {}
    for name, f in [("a2a", full), ("rs", rs)] * 2:
        dist.barrier(); f(); dist.barrier()
        ts = []
        for _ in range(20):
            dist.barrier(); t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        res[name] = statistics.median(ts) * 1e3
    return res
if __name__ == "__main__":
    print(bench.run_ranks(fn, 2, (), {"MALLOC_MMAP_THRESHOLD_": "65536"}, 10).results)

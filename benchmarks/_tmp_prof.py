import time, statistics
import torch, torch.distributed as dist
import _common as bench
import profile_step
from step_time import BenchArgs
from lightning_zero import collectives, gradient_reducer

def rank_fn(rank, world, variant, args, zero):
    acc = {}
    def timed(name, f):
        def g(*a, **k):
            w, c = time.perf_counter(), time.thread_time()
            try: return f(*a, **k)
            finally:
                x = acc.setdefault(name, [0.0, 0.0]); x[0] += time.perf_counter()-w; x[1] += time.thread_time()-c
        return g
    orig_wait = collectives.PendingCollective.wait
    def wait(self):
        w, c = time.perf_counter(), time.thread_time()
        for work in self.works: work.wait()
        self.works = ()
        x = acc.setdefault(f"works.wait {self.kind.value}", [0.0, 0.0]); x[0] += time.perf_counter()-w; x[1] += time.thread_time()-c
        w, c = time.perf_counter(), time.thread_time()
        if self.finish is not None:
            self.finish(); self.finish = None
        self.buffers = ()
        x = acc.setdefault(f"finish {self.kind.value}", [0.0, 0.0]); x[0] += time.perf_counter()-w; x[1] += time.thread_time()-c
    collectives.PendingCollective.wait = wait
    for cls in (gradient_reducer.FullGradReducer, gradient_reducer.ShardedGradReducer):
        cls._complete = timed(f"{cls.__name__}._complete", cls._complete)
    steps = profile_step.profile_rank(rank, world, variant, args, zero)
    n = args.warmup + args.steps
    return {k: (v[0]/n*1e3, v[1]/n*1e3) for k, v in acc.items()}

if __name__ == "__main__":
    import sys
    args = BenchArgs(world_size=2, steps=6, warmup=2)
    for variant in sys.argv[1].split(","):
        run = bench.run_ranks(rank_fn, 2, (variant, args, {"overlap_comm": True}), {"MALLOC_MMAP_THRESHOLD_": "65536"}, 20)
        print(variant, {k: tuple(round(x,1) for x in v) for k, v in run.results[0].items()})

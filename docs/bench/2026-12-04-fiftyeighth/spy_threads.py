"""A py-spy raw profile (`py-spy record -f raw --threads`) summed: the samples of each thread, then for the
threads whose name contains THREAD each function's share of their samples, where it was the leaf (self) and
anywhere on the stack (inclusive). Run:
    python docs/bench/2026-12-04-fiftyeighth/spy_threads.py RAW THREAD
"""

import collections
import sys


def main(raw: str, thread: str) -> None:
    threads: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    with open(raw) as f:
        for line in f:
            stack, count = line.rstrip().rsplit(" ", 1)
            n = int(count)
            frames = stack.split(";")
            threads[frames[0]] += n
            if thread in frames[0]:
                leaf[frames[-1]] += n
                for name in set(frames[1:]):
                    inclusive[name] += n
    print(threads.most_common(10))
    total = sum(v for k, v in threads.items() if thread in k)
    print("self")
    for name, n in leaf.most_common(25):
        print(f"{n / total * 100:5.1f} {name}")
    print("inclusive")
    for name, n in inclusive.most_common(45):
        print(f"{n / total * 100:5.1f} {name}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

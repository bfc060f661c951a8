"""tools/gpu_check.sh's driver: the whole GPU proof in one device call
(environment: the kit and the build; stages: the steps and their budgets;
targets: the benchmarks' numbers against docs/benchmarks.md; report: the
summary gpu_check.md). Not part of the a2a package."""

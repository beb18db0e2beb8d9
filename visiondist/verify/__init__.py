"""The dry run (tools/plan.py): a layout checked at full scale on one machine, each chosen rank
built by the training code over a fake process group and stepped once, its figures set beside the
planner's (`visiondist.plan`, which decides the layout; this package checks it by running the code).

- `dryrun.py`: which ranks, and the whole run; `world.py`: the fake world, collective counting,
  autocast on meta;
- `measure.py`: one rank measured and planned; `report.py`: the figures and the table.

Imports: everything up to `bench` (its synthetic batches).
"""

"""A run's life: its start (launch, placement, data, members, resume: `setup`), its slots (who rolls out and who
labels), its checkpoints (atomic step directories, background writes, resume), the guards that stop it (the
collapse guard's stop or rollback: `guard`; the non-finite steps: `numerics`), summary.json and the release at the
end (`summary`, `release`), and the users' hooks (`callbacks`). May import `monitor` and `rewards`; not the
phases."""

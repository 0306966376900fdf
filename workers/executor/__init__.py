"""Running a planned batch: tensors from the plan (model runner), the forward + sampling worker
(inline or on its own thread), and the process's CPU runtime settings."""

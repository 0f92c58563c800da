"""What a run's answers are measured with: FLOPs and MFU (`flops`), memory accounting
(`memory`), fp16 and gradient health (`health`) and the precision truth read off the model
(`truth`)."""

"""The answers a run can give beyond its own training, each found by measuring the user's model:
the largest batch each precision fits (max_batch.py), the fp32 islands a model needs to train in
fp16 (islands.py), and the final weights evaluated in the precisions one deploys in
(inference.py). They build and run trainers (runner/train/) and sit above them; run.py calls them."""

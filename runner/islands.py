"""`python -m runner.islands [overrides]`: the fp32 islands a model needs to train in its
precision, in any mode (runner/answers/island_search.py): `python -m runner.recipe`'s fp16 case
(runner/recipe.py), under the name it had first. It prints the trials and the config line to use,
and writes islands.json in its output folder. Exit 0: found; 1: no small set; 2: bad input."""

from runner.recipe import main

if __name__ == "__main__":
    main("islands")

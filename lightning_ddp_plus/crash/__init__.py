"""A rank's death during a fit: the survivors tell it from other failures, agree on the last optimizer step one of
them holds, and one of them saves that step; the run then ends with an error saying what was saved and how to resume.

May import: nothing of the package (the front end hands it the store, the ranks and the steps).
"""

"""smallbatch: do contrastive learners really need large batches?"""

__version__ = "0.1.0"

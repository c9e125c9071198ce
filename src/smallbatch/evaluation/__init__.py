"""A pretrained backbone judged: frozen features, kNN and linear probes, few-label probes, the
kNN monitor during training and the supervised baseline."""

#: decimals of an accuracy logged in percent: 10,000 test images resolve 0.01 points, and a fraction's last float
#: digits (100 x 0.8684 = 86.83999999999999) are arithmetic, not a measurement
PERCENT_DECIMALS = 4
#: the arm name of a steps-to-target sweep's supervised cross-entropy control (every other arm is a loss)
SUPERVISED_ARM = "supervised_ce"


def percent(fraction: float) -> float:
    """An accuracy (a fraction, counted in float64) in percent, rounded to :data:`PERCENT_DECIMALS`."""
    return round(100.0 * float(fraction), PERCENT_DECIMALS) + 0.0

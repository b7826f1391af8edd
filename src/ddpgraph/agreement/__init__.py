"""Every rank takes the same decision, or none does; what peers last reported."""

"""Demos that run the lesson's modules end to end and print what they show."""

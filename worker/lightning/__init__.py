"""Lightning strategy: data-parallel training of a LightningModule over a Sluice job started by `sluice launch`."""

// Run by the mongo image once, when the mongo-data volume is first initialised, in MONGO_INITDB_DATABASE
// (bountyboard): the user every bb_broker service connects as. readWrite covers jobs, plumbing messages and
// change streams; dbAdmin the index options the broker sets (collMod for the retention TTL).
db.createUser({
  user: process.env.BB_MONGO_USER,
  pwd: process.env.BB_MONGO_PASSWORD,
  roles: [
    { role: "readWrite", db: db.getName() },
    { role: "dbAdmin", db: db.getName() },
  ],
});
